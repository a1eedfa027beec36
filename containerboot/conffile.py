"""The tailscaled config file (`--config=`): HuJSON loading, checking and version-based file choice.

In one-step mode the operator mounts a directory of `cap-<N>.hujson` files, one per capability version it knows
how to render. We pick the newest one that this proxy understands, and check it the way upstream's containerboot
does before starting tailscaled with it: the text is HuJSON (JSON plus comments and trailing commas), its
`version` is `"alpha0"`, and it holds no field that tailscaled's `alpha0` schema does not know. Catching a bad
file here gives one clear error at boot instead of a tailscaled crash loop.

Only the top-level schema is checked, plus the two small nested objects; the nested serve config is left to
tailscaled. Keys match case-insensitively, as they do when tailscaled decodes the file.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tscommon import jsontext

__all__ = [
    "ConfigFile",
    "ConfigFileError",
    "authkey_from_config",
    "capver_from_filename",
    "load",
    "parse",
    "pick_config_file",
    "standardize",
]


class ConfigFileError(Exception):
    """The config file (or the directory holding it) is unusable. The message never holds the file's values."""


class NoConfigFileError(ConfigFileError):
    """The directory holds no config file for this capability version (or an older one)."""


# What tailscaled's "alpha0" schema accepts at the top level, by JSON name, with the JSON type each takes.
# "optbool" is tailscaled's opt.Bool, which decodes from a boolean, null or a string.
_STR, _OPTBOOL, _LIST, _OBJECT, _PORT = "string", "optbool", "list", "object", "port"
_FIELDS: Mapping[str, str] = {
    "Version": _STR,
    "Locked": _OPTBOOL,
    "ServerURL": _STR,
    "AuthKey": _STR,
    "Enabled": _OPTBOOL,
    "OperatorUser": _STR,
    "Hostname": _STR,
    "acceptDNS": _OPTBOOL,
    "acceptRoutes": _OPTBOOL,
    "exitNode": _STR,
    "allowLANWhileUsingExitNode": _OPTBOOL,
    "AdvertiseRoutes": _LIST,
    "DisableSNAT": _OPTBOOL,
    "AdvertiseServices": _LIST,
    "AppConnector": _OBJECT,
    "NetfilterMode": _STR,
    "NoStatefulFiltering": _OPTBOOL,
    "PostureChecking": _OPTBOOL,
    "RunSSHServer": _OPTBOOL,
    "RunWebClient": _OPTBOOL,
    "ShieldsUp": _OPTBOOL,
    "AutoUpdate": _OBJECT,
    "ServeConfigTemp": _OBJECT,
    "StaticEndpoints": _LIST,
    "RelayServerPort": _PORT,
    "RelayServerStaticEndpoints": _LIST,
}
# Nested objects small enough to check fully; an unknown key in them is as fatal to tailscaled as one at the top.
_NESTED: Mapping[str, frozenset[str]] = {
    "AppConnector": frozenset({"Advertise"}),
    "AutoUpdate": frozenset({"Check", "Apply"}),
}
_CANONICAL = {name.lower(): name for name in _FIELDS}


@dataclass(frozen=True)
class ConfigFile:
    """A checked config file. `fields` is keyed by the schema's spelling of each name, whatever the file used."""

    path: str
    version: str
    fields: Mapping[str, Any] = field(repr=False)  # may hold the auth key: keep it out of reprs and logs

    @property
    def auth_key(self) -> str:
        value = self.fields.get("AuthKey")
        return value if isinstance(value, str) else ""


def standardize(text: str) -> str:
    """Turn HuJSON into plain JSON: drop `//` and `/* */` comments and trailing commas.

    Comments become spaces (newlines kept) so that JSON error positions still point at the right line.
    """
    out: list[str] = []
    i, n = 0, len(text)
    pending_comma: int | None = None  # index in `out` of a comma that is dropped if `]` or `}` comes next
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                raise ConfigFileError("unterminated string")
            out.append(text[i:j + 1])
            pending_comma = None
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ConfigFileError("unterminated /* comment")
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j + 2]))
            i = j + 2
        elif c in " \t\r\n":
            out.append(c)
            i += 1
        else:
            if c in "]}" and pending_comma is not None:
                out[pending_comma] = " "
            pending_comma = len(out) if c == "," else None
            out.append(c)
            i += 1
    return "".join(out)


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON (and tailscaled) do not.
    raise ValueError(f"invalid literal {name}")


def _type_ok(kind: str, value: Any) -> bool:
    if value is None:
        return True  # JSON null leaves a field unset in tailscaled
    if kind == _STR:
        return isinstance(value, str)
    if kind == _OPTBOOL:
        return isinstance(value, (bool, str))
    if kind == _LIST:
        return isinstance(value, list)
    if kind == _OBJECT:
        return isinstance(value, dict)
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535


def parse(text: str, path: str = "<config>") -> ConfigFile:
    """Check HuJSON config text the way upstream's loader does, and return its fields."""
    try:
        document = jsontext.loads(standardize(text), parse_constant=_reject_constant)
    except (ValueError, ConfigFileError) as e:
        # json's messages give a position, never the content, so they are safe to show.
        raise ConfigFileError(f"{path}: not valid HuJSON/JSON: {e}") from None
    if not isinstance(document, dict):
        raise ConfigFileError(f"{path}: the top level must be a JSON object")

    fields: dict[str, Any] = {}
    for key, value in document.items():
        name = _CANONICAL.get(key.lower())
        if name is None:
            raise ConfigFileError(f"{path}: unknown field {key!r} (not in tailscaled's alpha0 config schema)")
        if not _type_ok(_FIELDS[name], value):
            raise ConfigFileError(f"{path}: field {key!r} must be a JSON {_FIELDS[name]}")
        allowed = _NESTED.get(name)
        if allowed is not None and isinstance(value, dict):
            known = {k.lower() for k in allowed}
            for sub in value:
                if sub.lower() not in known:
                    raise ConfigFileError(f"{path}: unknown field {key}.{sub!r}")
        fields[name] = value  # a repeated key: the last one wins, as in tailscaled's decoder

    version = fields.get("Version")
    if not version:
        raise ConfigFileError(f'{path}: no "version" field; want "alpha0"')
    if version != "alpha0":
        raise ConfigFileError(f'{path}: unsupported "version" value {version!r}; want "alpha0"')
    return ConfigFile(path=path, version=version, fields=fields)


def load(path: str) -> ConfigFile:
    """Read and check the config file at path."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"cannot read {path}: {e}") from None
    return parse(text, path)


def authkey_from_config(path: str) -> str:
    """The file's `AuthKey` (raw, `file:` prefix included), or "" if it is absent or the file is unusable."""
    try:
        return load(path).auth_key
    except ConfigFileError:
        return ""


_CAP_NAME = re.compile(r"cap-(0|[1-9][0-9]*)\.hujson")


def capver_from_filename(name: str) -> int | None:
    """The capability version a config file name is for, or None if it is not a config file name.

    `tailscaled` is the unversioned name, counted as version 0. Unlike upstream (which scans with Sscanf), the
    whole name must match, so `cap-95.hujson.bak` or `cap-095.hujson` are not mistaken for config files.
    """
    if name == "tailscaled":
        return 0
    m = _CAP_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def pick_config_file(directory: str, capver: int) -> str:
    """Path of the config file for the highest capability version <= capver in directory.

    Directories are skipped; symlinks are not, because kubelet mounts every file as a symlink. The path returned
    is the file that exists (upstream rebuilds the name from the number, which breaks for `tailscaled`).
    """
    try:
        with os.scandir(directory) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    except OSError as e:
        raise ConfigFileError(f"cannot list {directory}: {e.strerror or e}") from None
    best: tuple[int, str] | None = None
    for name, is_dir in sorted(entries):
        if is_dir:
            continue
        v = capver_from_filename(name)
        if v is not None and v <= capver and (best is None or v > best[0]):
            best = (v, name)
    if best is None:
        names = ", ".join(sorted(n for n, d in entries if not d)) or "no files"
        raise NoConfigFileError(
            f"no tailscaled config file for capability version {capver} or older in {directory} "
            f"(found: {names})")
    return os.path.join(directory, best[1])
