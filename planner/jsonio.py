"""JSON reading with clear errors, atomic writes (nothing half-written), and the small YAML writer exports use."""
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from planner.errors import UserError


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a JSON file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def writable_target(path: str | os.PathLike) -> Path:
    """The file an output path names: a symbolic link is followed; anything that exists and is
    not a regular file (a directory, /dev/full, a pipe) is refused, so it is never replaced."""
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path
    if target.exists() and not target.is_file():
        kind = "a directory" if target.is_dir() else "not a regular file"
        raise UserError(f"{path}: is {kind}; give a file name to write")
    if target.parent.exists() and not target.parent.is_dir():
        raise UserError(f"{path}: {target.parent} is not a directory")
    return target


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a temporary file in the same directory, then rename over the target (a regular file or nothing)."""
    path = writable_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{path}: cannot create its directory ({e.strerror})") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise UserError(f"{path}: cannot write there ({e.strerror})") from None
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; outputs should look like any other file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise UserError(f"{path}: cannot write ({e.strerror or e}); nothing written") from None
        raise
    return path


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


def to_yaml(obj: dict, comments: list[str] = (), indent: int = 0) -> str:
    """A small YAML writer for the settings above: nested mappings of scalars and flat lists
    (scalars in JSON spelling, which YAML reads alike); comments go first, one per line."""
    lines = [f"# {c}" for c in comments]
    lines += _yaml_lines(obj, indent)
    return "\n".join(lines) + "\n"


def _yaml_lines(obj: dict, indent: int) -> list[str]:
    pad = " " * indent
    out = []
    for key, value in obj.items():
        if isinstance(value, dict):
            out.append(f"{pad}{key}:")
            out += _yaml_lines(value, indent + 2)
        else:
            out.append(f"{pad}{key}: {json.dumps(value)}")
    return out
