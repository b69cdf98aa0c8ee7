"""Errors the compiler raises for bad input: the command line prints their message, never a traceback."""


class BuildError(Exception):
    """A build cannot proceed; the message says what is wrong and how to fix it."""


class RecipeError(BuildError):
    """A recipe is missing, malformed or invalid; the message names the key path."""
