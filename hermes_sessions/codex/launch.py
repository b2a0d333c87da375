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
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from .rollout_files import codex_state_files


class CodexNotInstalled(RuntimeError):
    """The pinned codex binary is missing; ``npm ci`` (``make install``) installs it."""


STAND_IN_KEY_ENV = "HERMES_STAND_IN_API_KEY"
OPENAI_KEY_ENV = "OPENAI_API_KEY"
#: Tries at wiping and re-making a session's home when something writes into it meanwhile (``prepare_session_home``).
HOME_WIPE_ATTEMPTS = 3

_COMMON_TOML = """\
approval_policy = "never"
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


def _common_toml() -> str:
    """``_COMMON_TOML``, with ``default_mode_request_user_input = true`` in ``[features]`` (its last table)
    when ``settings.CODEX_USER_INPUT_IN_DEFAULT_MODE``: codex 0.171.0 offers the model
    ``request_user_input`` in its Default collaboration mode only with that flag (without it the tool
    answers ``request_user_input is unavailable in Default mode``, observed), so questions reach a person
    (``item/tool/requestUserInput``, ``worker/approvals.py``) only then."""
    extra = "default_mode_request_user_input = true\n" if settings.CODEX_USER_INPUT_IN_DEFAULT_MODE else ""
    return _COMMON_TOML + extra


# Permission profiles (docs/codex.md §10): one per sandbox mode a session may have. No legacy
# ``sandbox_mode`` anywhere: it (or a legacy ``sandbox``/``sandboxPolicy`` request field) would replace
# the profile with the legacy sandbox, which reads everything the worker's Unix user can read.
PROFILES = {
    "read-only": "hermes-read-only",
    "workspace-write": "hermes-workspace-write",
    "danger-full-access": "hermes-danger-full-access",
}


def permission_profile(sandbox: str) -> str:
    """The profile id codex reports as ``activePermissionProfile.id`` for a session in ``sandbox`` mode."""
    try:
        return PROFILES[sandbox]
    except KeyError:
        raise ValueError(f"unknown sandbox mode {sandbox!r}") from None


def _codex_install_dir() -> Path | None:
    """The directory holding the native binary and its bundled bwrap: the sandbox re-executes the
    binary inside bubblewrap, so the profile must let it be read (docs/codex.md §10)."""
    if settings.CODEX_APP_SERVER_COMMAND and not settings.CODEX_BIN:
        return None
    try:
        return Path(codex_binary()).resolve().parent.parent
    except CodexNotInstalled:
        return None


def permission_filesystem(sandbox: str, workdir: Path) -> dict[str, str]:
    """The ``[permissions.<profile>.filesystem]`` table for a session whose work dir is ``workdir``.

    read-only / workspace-write: an allow-list — only the platform's basics (``:minimal``: /usr, /etc,
    /lib…), codex's own install directory and the session's work dir (``read`` / ``write``) are mounted;
    nothing else exists inside the sandbox: no other session's home or work dir, no ``var/``, no source
    tree, no ``/tmp``. (A ``read`` entry under a ``none`` root does not reopen it on 0.171.0, and
    ``extends = ":read-only"`` mounts all of ``/``: both measured, §10.)

    danger-full-access (staff only): ``/`` writable and the network on, but the service's own places are
    masked — ``HERMES_VAR_DIR``, ``CODEX_HOME``, ``CODEX_USER_HOME``, ``CODEX_HOMES_ROOT`` (every session's
    home), ``CODEX_WORK_ROOT`` (the session's
    own work dir reopened writable) and every top-level entry of the source tree except the one holding
    codex's install (``node_modules``)."""
    workdir = Path(workdir).resolve()
    if sandbox in ("read-only", "workspace-write"):
        table = {":minimal": "read"}
        install = _codex_install_dir()
        if install is not None:
            table[str(install)] = "read"
        table[str(workdir)] = "read" if sandbox == "read-only" else "write"
        return table
    if sandbox == "danger-full-access":
        table = {"/": "write"}
        install = _codex_install_dir()
        denied = {Path(settings.HERMES_VAR_DIR), Path(settings.CODEX_HOME), Path(settings.CODEX_USER_HOME),
                  Path(settings.CODEX_HOMES_ROOT), Path(settings.CODEX_WORK_ROOT)}
        base = Path(settings.BASE_DIR).resolve()
        for entry in sorted(base.iterdir()) if base.is_dir() else []:
            if install is not None and (install == entry.resolve() or entry.resolve() in install.parents):
                continue
            denied.add(entry)
        paths = {d.resolve() for d in denied} - {workdir, Path("/")}
        for path in sorted(paths):
            # Only the outermost denied paths: bwrap cannot mask a path inside an already masked one
            # ("Can't mkdir …: Read-only file system", measured). The own work dir is reopened below.
            if not any(other in path.parents for other in paths):
                table[str(path)] = "none"
        table[str(workdir)] = "write"
        return table
    raise ValueError(f"unknown sandbox mode {sandbox!r}")


def _network(sandbox: str) -> dict[str, bool]:
    return {"enabled": sandbox == "danger-full-access"}


def permissions_toml(sandbox: str, workdir: Path) -> str:
    """``[permissions.<profile>]`` tables for ``sandbox`` mode and ``workdir`` (TOML, after the top-level keys)."""
    name = permission_profile(sandbox)
    lines = [f"\n[permissions.{name}.filesystem]"]
    lines += [f"{json.dumps(path)} = {json.dumps(access)}" for path, access in permission_filesystem(sandbox, workdir).items()]
    lines += [f"\n[permissions.{name}.network]", f"enabled = {str(_network(sandbox)['enabled']).lower()}"]
    return "\n".join(lines) + "\n"


def permission_overrides(sandbox: str, workdir: Path) -> list[str]:
    """``-c`` arguments for ``codex app-server`` selecting the session's profile for ``workdir``: the
    per-session part while ``CODEX_HOME`` (and its ``config.toml``) is shared by all sessions. Measured on
    0.171.0: ``-c`` overrides apply to ``thread/start`` and ``thread/resume`` alike (docs/codex.md §10)."""
    name = permission_profile(sandbox)
    fs = ", ".join(f"{json.dumps(path)} = {json.dumps(access)}" for path, access in permission_filesystem(sandbox, workdir).items())
    net = str(_network(sandbox)["enabled"]).lower()
    return [
        "-c", f"default_permissions={json.dumps(name)}",
        "-c", f"permissions.{name}.filesystem={{{fs}}}",
        "-c", f"permissions.{name}.network={{enabled = {net}}}",
    ]


STAND_IN_DEFAULT_MODEL = "mock-model"
OPENAI_DEFAULT_MODEL = "gpt-5.5"


def default_model() -> str | None:
    """The model of a session whose ``model_config`` names none — the operator's current choice, read at
    each turn: ``CODEX_MODEL``, else the provider's default (``stand-in``: ``mock-model``, ``openai``:
    ``gpt-5.5``); with ``CODEX_MODEL_PROVIDER=config``, the ``model`` key of ``CODEX_CONFIG_TOML`` (``None``
    when it has none: codex's own default, nothing sent). The same name ``render_config_toml`` writes.

    Sent as ``model`` on every ``turn/start`` that carries overrides (``runner._turn_params``): codex 0.171.0
    keeps a resumed thread's model otherwise, whatever ``config.toml`` says (docs/operating.md §3)."""
    provider = settings.CODEX_MODEL_PROVIDER
    if provider == "config":
        try:
            model = tomllib.loads(Path(settings.CODEX_CONFIG_TOML).read_text()).get("model")
        except (OSError, tomllib.TOMLDecodeError):
            return None  # codex reads the same file at launch and says what is wrong with it
        return model if isinstance(model, str) and model else None
    if provider == "openai":
        return settings.CODEX_MODEL or OPENAI_DEFAULT_MODEL
    return settings.CODEX_MODEL or STAND_IN_DEFAULT_MODEL


def render_config_toml(*, home: Path | None = None, workdir: Path | None = None, sandbox: str = "read-only") -> str:
    """The ``config.toml`` for ``settings.CODEX_MODEL_PROVIDER``: ``stand-in`` (the local
    Responses-API stand-in at ``CODEX_STAND_IN_URL``) or ``openai`` (api.openai.com, key from
    ``OPENAI_API_KEY``). ``config`` mode copies the operator's ``CODEX_CONFIG_TOML`` verbatim.

    ``workdir`` given (a home that serves one session): the file selects that session's permission
    profile (``default_permissions``, before the first table) and defines it for ``workdir``. Without it
    (the shared home), the profile comes from ``permission_overrides`` on the command line. ``home`` is
    the home the file is for (unused in the text today; accepted so per-session homes can pass it)."""
    del home  # the text does not depend on where the file lives
    provider = settings.CODEX_MODEL_PROVIDER
    if provider == "config":
        return Path(settings.CODEX_CONFIG_TOML).read_text()
    top = f"default_permissions = {json.dumps(permission_profile(sandbox))}\n" if workdir is not None else ""
    tail = permissions_toml(sandbox, workdir) if workdir is not None else ""
    if provider == "stand-in":
        model = settings.CODEX_MODEL or STAND_IN_DEFAULT_MODEL
        return (
            f'model = {json.dumps(model)}\nmodel_provider = "hermes-stand-in"\n' + top
            + _common_toml()
            + "\n[model_providers.hermes-stand-in]\n"
            'name = "hermes_sessions local model stand-in"\n'
            f"base_url = {json.dumps(settings.CODEX_STAND_IN_URL)}\n"
            f'env_key = "{STAND_IN_KEY_ENV}"\n'
            'wire_api = "responses"\nrequest_max_retries = 0\nstream_max_retries = 0\nsupports_websockets = false\n'
            + tail
        )
    if provider == "openai":
        model = settings.CODEX_MODEL or OPENAI_DEFAULT_MODEL
        return (
            f'model = {json.dumps(model)}\nmodel_provider = "openai-api"\n' + top
            + _common_toml()
            + "\n[model_providers.openai-api]\n"
            'name = "OpenAI API"\nbase_url = "https://api.openai.com/v1"\n'
            f'env_key = "{OPENAI_KEY_ENV}"\nwire_api = "responses"\n'
            + tail
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


def prepare_session_home(session_id: str, *, sandbox: str | None = None, workdir: Path | None = None,
                         keep: Path | None = None) -> SessionHome:
    """Wipe and recreate ``session_id``'s home and ``HOME`` (a worker's disk is a cache: nothing
    from an earlier turn survives but what ``keep`` names — ``docs/codex.md`` §7), then write
    its ``config.toml`` — with ``sandbox`` and ``workdir``, one that also selects and defines the
    session's permission profile, so even an app-server started without ``permission_overrides`` runs
    the session's commands under it. ``keep``: the thread's rollout this process holds unchanged
    (``rollout_files.held_rollout``), left in place with codex's sqlite projection of it
    (``rollout_files.codex_state_files``): its restore then appends only what it lacks, and codex
    projects only those bytes instead of the whole file at start and at ``thread/resume``. The caller
    drops that projection when the restore does not extend the kept file (``rollout_files.drop_codex_state``).
    Returns the paths; the caller restores the thread's rollout into it."""
    paths = session_home(session_id)
    if keep is not None and not keep.resolve().is_relative_to(paths.home):
        keep = None
    kept = set() if keep is None else {keep.resolve(), *(p.resolve() for p in codex_state_files(paths.home))}
    for attempt in range(HOME_WIPE_ATTEMPTS):
        if not kept:
            shutil.rmtree(paths.home.parent, ignore_errors=True)
        else:
            _remove_all_but(paths.home.parent, kept)
        try:
            paths.home.mkdir(parents=True, exist_ok=bool(kept))
            break
        except FileExistsError:
            # Something wrote into the home while it was being removed — an app-server of an earlier run of the
            # session on this host, still exiting (``make faults`` db-down-during-restore: a turn failed with
            # "[Errno 17] File exists" on the retried restore). Remove it again rather than fail the turn.
            if attempt == HOME_WIPE_ATTEMPTS - 1:
                raise
            time.sleep(0.05)
    paths.user_home.mkdir(parents=True)
    write_home_config(paths.home, sandbox=sandbox, workdir=workdir)
    return paths


def _remove_all_but(root: Path, keep: set[Path]) -> None:
    """Remove everything under ``root`` except the files in ``keep`` and the directories leading to them."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    for entry in entries:
        path = Path(entry.path)
        if path in keep:
            continue
        if entry.is_dir(follow_symlinks=False) and any(k.is_relative_to(path) for k in keep):
            _remove_all_but(path, keep)
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def write_home_config(home: Path, *, sandbox: str | None = None, workdir: Path | None = None) -> None:
    """The one place ``config.toml`` is rendered and written into ``home`` (atomically: temp file +
    rename). With ``sandbox`` and ``workdir``: a config selecting and defining that session's permission
    profile. Codex reads it again at every ``thread/resume``, so writing it into a running spare's home
    after ``initialize`` gives the resumed thread the session's profile (``docs/codex.md`` §11)."""
    target = home / "config.toml"
    tmp = home / f".config.toml.{os.getpid()}"
    if sandbox is not None and workdir is not None:
        tmp.write_text(render_config_toml(home=home, workdir=workdir, sandbox=sandbox))
    else:
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
    write_home_config(home)
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


# Every app-server we spawn (cold, spares, tools) reads no project docs (AGENTS.md). Codex 0.171.0,
# measured (docs/codex.md §11): under an allow-list permission profile, codex looks for project docs at
# every thread/start and thread/resume — AGENTS.override.md and AGENTS.md in the cwd, and a `.git`
# marker in every ancestor of it — with one `fs/getMetadata` per path, each in a fresh sandboxed helper
# process (codex-linux-sandbox → bwrap `--help` probe → bwrap → `codex --codex-run-as-fs-helper`), one
# after the other: 8 of the 10 helper processes of a resume, most of its cost. `project_doc_max_bytes = 0`
# (documented: the byte budget of project docs; 0 returns before any lookup) removes them. The sandbox
# the model's commands run in is unchanged; codex simply reads nothing more from the work dir at resume.
# Sessions get their instructions from the service (`developerInstructions`), never from an AGENTS.md.
NO_PROJECT_DOCS = ["-c", "project_doc_max_bytes=0"]


def app_server_argv(*, sandbox: str | None = None, workdir: Path | None = None) -> list[str]:
    """The command that starts one app-server: ``settings.CODEX_APP_SERVER_COMMAND`` (a JSON list;
    the tests' scripted stand-in) or ``[<native codex>, "app-server"]``; with ``sandbox`` and
    ``workdir``, followed by ``permission_overrides`` (the session's permission profile); always followed
    by ``NO_PROJECT_DOCS`` (no AGENTS.md lookups: they cost a sandboxed process each, docs/codex.md §11)
    unless ``settings.CODEX_PROJECT_DOCS`` asks for codex's project docs (the behaviour before; the
    bench's baseline stack)."""
    extra = permission_overrides(sandbox, workdir) if sandbox is not None and workdir is not None else []
    if not settings.CODEX_PROJECT_DOCS:
        extra = extra + NO_PROJECT_DOCS
    if settings.CODEX_APP_SERVER_COMMAND:
        argv = json.loads(settings.CODEX_APP_SERVER_COMMAND)
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("CODEX_APP_SERVER_COMMAND must be a JSON list of strings")
        return argv + extra
    return [codex_binary(), "app-server", *extra]


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
