"""Where the client's requests go: the server's URL (`--url`, else INFERGATE_URL, else the
port of the project's profile, else the default), a token that an HTTP header can carry,
and the paths built from names, each name one escaped path segment, so that no name or
version (`a/b`, `..`, `x?y`) can address another endpoint."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from urllib.parse import quote, urlsplit

from infergate.client_errors import UrlError

DEFAULT_URL = "http://127.0.0.1:8000"


def normalize_url(text: str, what: str = "--url") -> str:
    """`localhost:8000` and `http://localhost:8000/` both mean http://localhost:8000.
    UrlError (naming `what`) for an address that is not an http(s) URL of a host and port."""
    given = text
    text = text.strip()
    url = (text if "://" in text else f"http://{text}").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UrlError(f"{what} {given!r}: not an http:// or https:// address")
    if any(c.isspace() for c in url):
        raise UrlError(f"{what} {given!r}: an address holds no spaces")
    if not parts.hostname:
        raise UrlError(f"{what} {given!r}: no host in it (like localhost:8000)")
    try:
        parts.port  # noqa: B018  (reading it checks it)
    except ValueError:
        raise UrlError(f"{what} {given!r}: the port is not a number from 0 to 65535") from None
    if parts.query or parts.fragment:
        raise UrlError(f"{what} {given!r}: a server address has no ?query or #fragment")
    # An endpoint's URL pasted whole (http://h:8000/v2, .../v2/health/ready): the paths
    # the commands add begin so. (A proxy's prefix, /ml or /api/v2, stays the address's.)
    if parts.path.lstrip("/").split("/", 1)[0].lower() in ("v2", "admin", "metrics"):
        raise UrlError(
            f"{what} {given!r}: give the server's own address "
            f"({parts.scheme}://{parts.netloc}): the commands add /v2/..., /admin/... and "
            "/metrics to it"
        )
    return url


def tls_verify_for(url: str) -> ssl.SSLContext:
    """What a client of `url` checks TLS with. For https: httpx's own choice, the CA bundle
    (or SSL_CERT_FILE's), loaded now, so that a file that cannot be read is a UrlError
    naming it, not a crash mid-command. For http: a context that trusts nobody, made in
    0.3 ms where loading a bundle costs 35-42 ms of CPU (a tenth of a command's), for a
    client that never speaks TLS to its server (its requests all go to `url`, it follows
    no redirect; a TLS proxy, HTTPS_PROXY, is checked by httpx's own context); were it
    ever to, it would refuse every certificate. Nor does a stale SSL_CERT_FILE then stop
    a command to a plain http server. (A missing SSL_CERT_DIR raises nothing here: its
    certificates are looked up per handshake, which then fails to verify.)"""
    if urlsplit(url).scheme != "https":
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    import httpx

    try:
        return httpx.create_ssl_context()
    except OSError as exc:  # a file not there or unreadable; ssl.SSLError: no PEM in it
        # (httpx reads SSL_CERT_FILE if set, else SSL_CERT_DIR, else certifi's bundle)
        named = os.environ.get("SSL_CERT_FILE")
        where = f" (SSL_CERT_FILE={named!r})" if named else ""
        cause = exc.strerror or str(exc)
        raise UrlError(
            f"{url}: cannot load the certificates to check its TLS with{where}: {cause}. "
            "Hint: point SSL_CERT_FILE at PEM certificates, or unset it"
        ) from None


PROJECT_PROFILE = Path("profiles") / "default.toml"


def _read_project_profile(folder: Path | None) -> tuple[Path, bytes] | None:
    """./profiles/default.toml in `folder` (else the working directory) and its bytes, read
    as `serve` reads a profile (a regular file, not too large); None when there is none.
    UrlError for one that is no regular file or cannot be read (a FIFO would block for
    ever, /dev/zero never end): the server's address cannot be known from it."""
    from infergate.errors import ConfigError
    from infergate.settings.table import MAX_PROFILE_BYTES, read_toml

    path = PROJECT_PROFILE if folder is None else folder / PROJECT_PROFILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return path, read_toml(path, MAX_PROFILE_BYTES)
    except ConfigError as exc:
        raise UrlError(
            f"{path}, read for the port of the server started here (--url or INFERGATE_URL "
            f"skips it): {str(exc).removeprefix(f'{path}: ')}"
        ) from None


def project_port(folder: Path | None = None) -> int | None:
    """The port of profiles/default.toml in `folder` (the working directory), if any: run
    in a project folder, the CLI finds the server that `infergate serve` started there.
    None when the file is absent or does not parse; UrlError when it cannot be read."""
    from infergate.errors import ConfigError
    from infergate.settings.table import parse_toml

    found = _read_project_profile(folder)
    if found is None:
        return None
    try:
        doc = parse_toml(*found)
    except ConfigError:
        return None
    server = doc.get("server")
    port = server.get("port") if isinstance(server, dict) else None
    return port if isinstance(port, int) and 0 < port < 65536 else None


def project_profile_unread(folder: Path | None = None) -> str | None:
    """Why ./profiles/default.toml, present, gave no port (a broken edit): the server that
    started from it may listen elsewhere than the URL tried. None when it did, or is absent."""
    from infergate.errors import ConfigError
    from infergate.settings.table import parse_toml

    if os.environ.get("INFERGATE_URL", "").strip():
        return None
    try:
        found = _read_project_profile(folder)
    except UrlError:  # said when the client was made (unless --url skipped the file)
        return None
    if found is None:
        return None
    try:
        parse_toml(*found)
    except ConfigError as exc:
        said = str(exc).removeprefix(f"{found[0]}: not valid TOML: ")
        return f"{PROJECT_PROFILE} does not parse ({said}), so its port was not used"
    return None


def default_url() -> str:
    """$INFERGATE_URL (with or without a scheme), else the port of ./profiles/default.toml,
    else http://127.0.0.1:8000."""
    env = os.environ.get("INFERGATE_URL", "").strip()
    if env:
        return normalize_url(env, "INFERGATE_URL")
    port = project_port()
    return f"http://127.0.0.1:{port}" if port is not None else DEFAULT_URL


def check_token(token: str) -> None:
    """UrlError for a token an HTTP header cannot carry (httpx would fail on it later)."""
    if not token.isascii() or not token.isprintable():
        raise UrlError(
            "the token holds characters an HTTP header cannot carry (non-ASCII, or control "
            "characters such as a newline); check --token or its environment variable"
        )


def segment(name: str) -> str:
    """`name` as one path segment: every character but letters, digits and `_.-~` escaped
    (`a/b` is `a%2Fb`), and `.` and `..`, which a URL reads as steps up the path, as
    `%2E` and `%2E%2E` (the server decodes them back to the name). ValueError for an empty
    name, which would leave the segment out and address the collection."""
    if not name:
        raise ValueError("an empty name or version is no path segment")
    escaped = quote(name, safe="")
    return escaped.replace(".", "%2E") if escaped in (".", "..") else escaped


def model_path(model: str, version: str | None) -> str:
    """/v2/models/NAME[/versions/V], each part escaped (a version `../x` stays a version)."""
    path = f"/v2/models/{segment(model)}"
    return path + (f"/versions/{segment(version)}" if version else "")
