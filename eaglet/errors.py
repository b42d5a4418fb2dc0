"""User errors: one sentence saying what is wrong and how to fix it."""


class EagletError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""
