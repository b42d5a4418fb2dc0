"""User errors: one sentence saying what is wrong and how to fix it."""


class EagletError(Exception):
    """A problem with the user's input or environment, reported without a traceback."""


def read_json_file(file, what: str) -> dict:
    """A JSON object a user handed over (a config.json, a reference draft config), or one sentence saying why
    it cannot be read."""
    import json

    try:
        data = json.loads(open(file, encoding="utf-8").read())
    except UnicodeDecodeError:
        raise EagletError(f"{what} {file} is not UTF-8 text") from None
    except ValueError as e:
        raise EagletError(f"{what} {file} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise EagletError(f"{what} {file} must hold a JSON object, not {type(data).__name__}")
    return data
