"""User-facing errors: one line, non-zero exit, no traceback (see workflows.cli.main.main)."""


class UserError(Exception):
    """Bad input from the user: a file, a field or an option. Printed as one line by the CLI."""


def where(path, field: str | None = None) -> str:
    """'FILE' or 'FILE: field' prefix for error messages."""
    return f"{path}: {field}" if field else f"{path}"


class PlainIsFastest(UserError):
    """The planner predicts plain decoding at least as fast as any tree (a schedule may say "no
    speculation" there; a single plan refuses to write an empty tree)."""
