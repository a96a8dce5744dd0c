"""torch's pickles read into inert records and written back from them: nothing in a pickle is ever executed."""
