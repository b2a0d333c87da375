"""``make faults`` — fault injection against the real stack; nothing lost, nothing doubled, nothing stuck.

Run as ``python -m devtools.faults [--scenarios …]`` (``make faults`` sets ``DATABASE_URL``). One private
stack per run, all real processes on this machine (:mod:`.supervisor`):

* PostgreSQL: a database ``<name>_faults`` beside ``DATABASE_URL``, dropped and created afresh, migrated;
* a **private** ``redis-server`` started by the harness on a free port (the broker; the shared Redis is
  never touched — ``broker-restart`` kills and restarts only this one, which keeps nothing on disk);
* the model stand-in (``python -m devtools.model_stand_in``; an input with ``SLOW`` streams its
  reply over ``--slow-seconds``, so a kill lands mid-turn);
* gunicorn serving the REST API, driven over HTTP with a token user, as a client would;
* Celery turn workers (``-Q <unique queue> -c 1``, four by default: ``--workers``, ``--concurrency``),
  each in its own process group so a whole worker (MainProcess and prefork child) can be ``kill -9``-ed;
  running one turn at a time, each also has a route (woken by NOTIFY) and keeps the app-servers of the
  sessions it ran loaded between their turns (session affinity, warm processes in play), plus one
  sweep worker with embedded beat (``hermes_sessions.tasks.sweep_turns`` every second) on the default
  queue (killed only by ``kill-beat-with-worker``);
* a TCP proxy (:mod:`.pgproxy`, a thread of the harness) through which the turn workers — and only
  they — reach PostgreSQL: it can cut them off, or stop a worker at an exact SQL statement;
* codex app-servers (the pinned binary), spawned by the workers for a cold turn and kept running with
  the thread loaded after it, with ``CODEX_HOME`` under a temp dir.

Every process of the stack imports the project from a snapshot of the working tree taken at start-up
(tracked and untracked files, as they are then), so edits made while the suite runs cannot mix two
versions of the code in one run.

The scenarios (``--scenarios``, comma-separated; all by default) are in :mod:`.scenarios`:
``kill-worker``, ``duplicate-delivery``, ``concurrent-posts``, ``broker-restart``; in
:mod:`.rollout_scenarios` ``kill-during-rollout`` and ``db-down-during-restore``; and in
:mod:`.warm_scenarios` ``warm-codex-dies``, ``kill-warm-holder``, ``freeze-warm-holder`` and
``kill-beat-with-worker`` (the one that kills the sweeper too, and starts a fresh one); and in
:mod:`.approval_scenarios` ``kill-while-approval-waits``. After each (every
accepted turn terminal, bounded by ``--bound``) :mod:`.invariants` checks the database and the stack;
``tests/devtools/faults/`` plants defects and shows the checks report each. :mod:`.cli` prints one row
per scenario and exits 0 only when every row is clean and no codex app-server outlived its worker
(checked after every scenario, for the workers killed in it too, and after the last one stopped).
"""
