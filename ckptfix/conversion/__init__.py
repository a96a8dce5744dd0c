"""``convert``: the plan of a conversion and the file or folder conversion that carries it out."""
