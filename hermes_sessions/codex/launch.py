"""How a worker launches ``codex app-server``: the binary, ``CODEX_HOME``, ``config.toml`` and the
process environment, all from Django settings (``CODEX_*``).

Facts from codex 0.169.0 (``docs/codex.md`` §1 and §8):
- spawn the native binary, not the npm node wrapper: killing the wrapper orphans the server,
  which keeps the thread's writer lock;
- ``CODEX_HOME`` must be an absolute, existing directory, else the process exits at start-up;
- ``[features] plugins = false`` stops all start-up phone-home; ``unbounded_connection_retries =
  false`` with zero request/stream retries makes an unreachable model fail the turn in ~0.2 s
  instead of retrying forever.
The environment is an allow-list: the worker's database URL, broker URL and other secrets never
reach codex; only the model provider's key does.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings


class CodexNotInstalled(RuntimeError):
    """The pinned codex binary is missing; ``npm ci`` (``make install``) installs it."""


STAND_IN_KEY_ENV = "HERMES_STAND_IN_API_KEY"
OPENAI_KEY_ENV = "OPENAI_API_KEY"

_COMMON_TOML = """\
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

# Commands the model runs see only the basics (HOME, PATH, …), never the provider key or
# anything else in the app-server's environment.
[shell_environment_policy]
inherit = "core"
exclude = ["*KEY*", "*SECRET*", "*TOKEN*", "*PASSWORD*"]

[features]
plugins = false
remote_plugin = false
apps = false
shell_snapshot = false
unbounded_connection_retries = false
"""


def render_config_toml() -> str:
    """The ``config.toml`` for ``settings.CODEX_MODEL_PROVIDER``: ``stand-in`` (the local
    Responses-API stand-in at ``CODEX_STAND_IN_URL``) or ``openai`` (api.openai.com, key from
    ``OPENAI_API_KEY``). ``config`` mode copies the operator's ``CODEX_CONFIG_TOML`` verbatim."""
    provider = settings.CODEX_MODEL_PROVIDER
    if provider == "config":
        return Path(settings.CODEX_CONFIG_TOML).read_text()
    if provider == "stand-in":
        model = settings.CODEX_MODEL or "mock-model"
        return (
            f'model = {json.dumps(model)}\nmodel_provider = "hermes-stand-in"\n'
            + _COMMON_TOML
            + "\n[model_providers.hermes-stand-in]\n"
            'name = "hermes_sessions local model stand-in"\n'
            f"base_url = {json.dumps(settings.CODEX_STAND_IN_URL)}\n"
            f'env_key = "{STAND_IN_KEY_ENV}"\n'
            'wire_api = "responses"\nrequest_max_retries = 0\nstream_max_retries = 0\nsupports_websockets = false\n'
        )
    if provider == "openai":
        model = settings.CODEX_MODEL or "gpt-5.5"
        return (
            f'model = {json.dumps(model)}\nmodel_provider = "openai-api"\n'
            + _COMMON_TOML
            + "\n[model_providers.openai-api]\n"
            'name = "OpenAI API"\nbase_url = "https://api.openai.com/v1"\n'
            f'env_key = "{OPENAI_KEY_ENV}"\nwire_api = "responses"\n'
        )
    raise ValueError(f"CODEX_MODEL_PROVIDER must be stand-in, openai or config, not {provider!r}")


@dataclass(frozen=True)
class SessionHome:
    """The directories one session's app-server runs with (all absolute):
    ``home`` is its ``CODEX_HOME`` (``CODEX_HOMES_ROOT/<session id>/home``), ``user_home`` the
    ``HOME`` beside it (``…/<session id>/user_home``). The same absolute path on every host, so a
    thread moving between hosts adds no extra skills developer message (``docs/codex.md`` §7)."""

    home: Path
    user_home: Path


def session_home(session_id: str) -> SessionHome:
    """The paths of ``session_id``'s home under ``settings.CODEX_HOMES_ROOT`` (nothing created).
    Session ids never contain ``/`` and never start with ``.`` (``models.SESSION_ID_RE``)."""
    root = Path(settings.CODEX_HOMES_ROOT).resolve() / session_id
    return SessionHome(home=root / "home", user_home=root / "user_home")


def prepare_session_home(session_id: str) -> SessionHome:
    """Wipe and recreate ``session_id``'s home and ``HOME`` (a worker's disk is a cache: nothing
    from an earlier turn, host-local sqlite included, survives — ``docs/codex.md`` §7), then write
    its ``config.toml``. Returns the paths; the caller restores the thread's rollout into it."""
    paths = session_home(session_id)
    shutil.rmtree(paths.home.parent, ignore_errors=True)
    paths.home.mkdir(parents=True)
    paths.user_home.mkdir(parents=True)
    _write_config(paths.home)
    return paths


def _write_config(home: Path) -> None:
    """The one place ``config.toml`` is rendered and written (atomically: temp file + rename)."""
    target = home / "config.toml"
    tmp = home / f".config.toml.{os.getpid()}"
    tmp.write_text(render_config_toml())
    os.replace(tmp, target)


def ensure_codex_home() -> Path:
    """Create the shared ``settings.CODEX_HOME`` and its ``config.toml`` — for tools that drive
    codex outside a session (the contract tests, the bench); turns use ``prepare_session_home``.
    ``settings.CODEX_HOME`` is otherwise only read: the legacy location of rollouts written before
    they were kept in PostgreSQL (``services/rollouts.py`` imports them)."""
    home = Path(settings.CODEX_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    Path(settings.CODEX_USER_HOME).resolve().mkdir(parents=True, exist_ok=True)
    _write_config(home)
    return home


def codex_binary() -> str:
    """Path of the native codex binary: ``settings.CODEX_BIN`` or the one the pinned npm package
    installed under ``node_modules/@openai/codex-linux-*/vendor/*/bin/codex``."""
    if settings.CODEX_BIN:
        return settings.CODEX_BIN
    pattern = str(Path(settings.CODEX_NODE_MODULES) / "@openai" / "codex-linux-*" / "vendor" / "*" / "bin" / "codex")
    if pattern not in _found:
        found = sorted(glob.glob(pattern))
        if not found:
            raise CodexNotInstalled(f"codex binary not found ({pattern}); run `make install` (npm ci)")
        _found[pattern] = found[0]
    return _found[pattern]


_found: dict[str, str] = {}  # glob pattern → binary (the install does not move while a worker runs)


def app_server_argv() -> list[str]:
    """The command that starts one app-server: ``settings.CODEX_APP_SERVER_COMMAND`` (a JSON list;
    the tests' scripted stand-in) or ``[<native codex>, "app-server"]``."""
    if settings.CODEX_APP_SERVER_COMMAND:
        argv = json.loads(settings.CODEX_APP_SERVER_COMMAND)
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("CODEX_APP_SERVER_COMMAND must be a JSON list of strings")
        return argv
    return [codex_binary(), "app-server"]


def app_server_env(home: SessionHome | None = None) -> dict[str, str]:
    """The app-server's whole environment (an allow-list, nothing inherited wholesale), with
    ``CODEX_HOME``/``HOME`` of ``home`` (a session's) or, without it, the shared ``settings.CODEX_HOME``
    and ``settings.CODEX_USER_HOME`` (tools outside a session)."""
    if home is None:
        home = SessionHome(home=Path(settings.CODEX_HOME).resolve(), user_home=Path(settings.CODEX_USER_HOME).resolve())
    path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    if not settings.CODEX_APP_SERVER_COMMAND:
        # The bundled bubblewrap lives here; on PATH it silences codex's configWarning.
        resources = Path(codex_binary()).parent.parent / "codex-resources"
        if resources.is_dir():
            path = f"{resources}{os.pathsep}{path}"
    env = {
        "PATH": path,
        "HOME": str(home.user_home),
        "CODEX_HOME": str(home.home),
        "RUST_LOG": os.environ.get("CODEX_RUST_LOG", "warn"),
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "LANG": "C.UTF-8",
    }
    if settings.CODEX_MODEL_PROVIDER == "stand-in":
        env[STAND_IN_KEY_ENV] = "stand-in"
    elif settings.CODEX_MODEL_PROVIDER == "openai" and os.environ.get(OPENAI_KEY_ENV):
        env[OPENAI_KEY_ENV] = os.environ[OPENAI_KEY_ENV]
    for name in filter(None, os.environ.get("CODEX_PASS_ENV", "").split(",")):
        if name in os.environ:  # operator-granted extras, e.g. a custom provider's key
            env[name] = os.environ[name]
    return env
