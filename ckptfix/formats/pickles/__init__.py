"""pickles"""
