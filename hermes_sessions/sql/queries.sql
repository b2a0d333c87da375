-- The service's hand-written SQL: every statement the code runs by hand, by name (``hermes_sessions.sql``
-- loads this file once: ``query(name)``). A statement starts at its ``-- name: <name>`` line and ends at the
-- next one; the ``--`` lines under the name say what it does, its parameters (``%s`` in order, or
-- ``%(name)s``) and what it returns. Its lines are joined with single spaces, so the text sent is the same
-- whatever the line breaks here (plans, prepared statements and the fault proxy's byte patterns see one text).
--
-- Tables and columns are spelled as the migrations made them (the models' ``db_table`` and columns):
-- tests/test_sql_statements.py prepares every statement against the migrated test database, so a renamed
-- table or column fails a test, not production. Two placeholders are filled in by the caller before a
-- statement is sent: ``{values}`` (the rows of an event write, ``events._events_statement``) and ``{rows}``
-- (``sql.value_rows``); ``{channel}`` is a quoted identifier (``LISTEN`` takes no parameter).


-- ====================================================================================================
-- the claim, the locks, the enqueue (services/turns.py, services/locks.py)
-- ====================================================================================================

-- name: lock_session_and_turn
-- Both rows of a turn, its session's locked first (``FOR UPDATE``), one row of every column of
-- ``Session`` then every column of ``Turn`` (``sql.rows.instance_from_row``); no row: no such turn.
-- The session row is locked inside the ``MATERIALIZED`` CTE, whose rows the join must read before the
-- top ``LockRows`` node can lock the turn row: session, then turn, whatever the join order (the ORM's
-- ``select_for_update(of=…)`` locks a join's rows in the order the executor picks). Under READ COMMITTED
-- each ``FOR UPDATE`` returns the row's latest committed version. Parameters: ``%(turn)s``.
WITH s AS MATERIALIZED (SELECT * FROM "hermes_sessions_session" WHERE "id" = (SELECT "session_id" FROM
    "hermes_sessions_turn" WHERE "id" = %(turn)s) FOR UPDATE) SELECT s."id", s."owner_id", s."title",
    s."model_config", s."last_message_seq", s."last_turn_seq", s."created_at", s."updated_at", t."id",
    t."session_id", t."seq", t."status", t."input", t."thread_action", t."codex_thread_id", t."codex_turn_id",
    t."codex_methods", t."final_text", t."error", t."usage", t."timings", t."attempt", t."claim_token",
    t."lease_expires_at", t."dispatched_at", t."cancel_requested_at", t."created_by_id", t."created_at",
    t."started_at", t."finished_at" FROM s JOIN "hermes_sessions_turn" t ON t."session_id" = s."id" WHERE
    t."id" = %(turn)s FOR UPDATE OF t;

-- name: lock_session_and_turn_skip_locked
-- ``lock_session_and_turn`` with ``SKIP LOCKED`` on both locks: a session row locked by another empties
-- the CTE, a turn row the join — no row, no wait (``recovery.leases_take_back``).
WITH s AS MATERIALIZED (SELECT * FROM "hermes_sessions_session" WHERE "id" = (SELECT "session_id" FROM
    "hermes_sessions_turn" WHERE "id" = %(turn)s) FOR UPDATE SKIP LOCKED) SELECT s."id", s."owner_id",
    s."title", s."model_config", s."last_message_seq", s."last_turn_seq", s."created_at", s."updated_at",
    t."id", t."session_id", t."seq", t."status", t."input", t."thread_action", t."codex_thread_id",
    t."codex_turn_id", t."codex_methods", t."final_text", t."error", t."usage", t."timings", t."attempt",
    t."claim_token", t."lease_expires_at", t."dispatched_at", t."cancel_requested_at", t."created_by_id",
    t."created_at", t."started_at", t."finished_at" FROM s JOIN "hermes_sessions_turn" t ON t."session_id" =
    s."id" WHERE t."id" = %(turn)s FOR UPDATE OF t SKIP LOCKED;

-- name: lock_timeout_bound
-- Every lock wait of the transaction ends after %s (``'<n>ms'``) with SQLSTATE 55P03, until it ends.
SELECT set_config('lock_timeout', %s, true);

-- name: statement_timeout_bound
-- Every statement of the transaction ends after %s (``'<n>ms'``) with SQLSTATE 57014, until it ends.
SELECT set_config('statement_timeout', %s, true);

-- name: advisory_xact_lock
-- A transaction-scoped advisory lock on the 64-bit key %s.
SELECT pg_advisory_xact_lock(%s);

-- name: claim
-- The claim's decision and writes as one statement, after ``lock_session_and_turn`` in the same
-- transaction: under READ COMMITTED its snapshot is taken after the lock waits and sees every turn
-- committed before the locks were granted (never folded into the locking statement, whose snapshot
-- predates its waits). CTEs: ``clk`` the statement's clock (read once, after the locks); ``me`` the
-- turn; ``blk`` whether another turn of the session runs or an earlier one is still queued (I3); ``ok``
-- the turn if it may run now (queued, no cancel asked for, not blocked); ``upd`` marks it running under
-- the new claim token, attempt + 1 and the lease; ``want`` / ``sess`` / ``ins`` write the user's
-- transcript row with the session's next sequence number — at the first claim, or at a re-claim that
-- finds none. (PostgreSQL runs every data-modifying CTE whether or not the result reads it.)
-- Parameters: ``turns._claim_params``. One row: the new ``attempt`` (NULL: nothing was claimed), the
-- active binding's thread id and that thread's stored rollout generation (NULL: none stored; ``lower``
-- as ``rollouts.rollout_state`` lower-cases codex's UUIDs); a turn that does not exist gives NULLs.
WITH clk AS (SELECT clock_timestamp() AS now),
me AS (SELECT "id", "session_id", "seq", "attempt", "status", "cancel_requested_at", "input" FROM
    "hermes_sessions_turn" WHERE "id" = %(turn)s),
blk AS (SELECT EXISTS (SELECT 1 FROM "hermes_sessions_turn" o JOIN me ON o."session_id" = me."session_id"
    WHERE o."id" <> me."id" AND (o."status" = %(running)s OR (o."status" = %(queued)s AND o."seq" <
    me."seq"))) AS blocked),
ok AS (SELECT me.* FROM me CROSS JOIN blk WHERE me."status" = %(queued)s AND me."cancel_requested_at" IS NULL
    AND NOT blk.blocked),
upd AS (UPDATE "hermes_sessions_turn" u SET "status" = %(running)s, "started_at" = (SELECT now FROM clk),
    "attempt" = u."attempt" + 1, "claim_token" = %(token)s, "lease_expires_at" = %(lease)s FROM ok WHERE
    u."id" = ok."id" RETURNING u."attempt"),
want AS (SELECT ok."id", ok."session_id", ok."input" FROM ok WHERE ok."attempt" = 0 OR NOT EXISTS (SELECT 1
    FROM "hermes_sessions_message" x WHERE x."turn_id" = ok."id" AND x."role" = %(user)s)),
sess AS (UPDATE "hermes_sessions_session" v SET "last_message_seq" = v."last_message_seq" + 1, "updated_at" =
    (SELECT now FROM clk) FROM want WHERE v."id" = want."session_id" RETURNING v."last_message_seq"),
ins AS (INSERT INTO "hermes_sessions_message" ("session_id", "seq", "turn_id", "role", "content",
    "tool_calls", "tool_call_id", "reasoning", "codex_item_id", "created_at") SELECT want."session_id",
    sess."last_message_seq", want."id", %(user)s, want."input", NULL::jsonb, '', '', '', (SELECT now FROM clk)
    FROM want CROSS JOIN sess RETURNING 1) SELECT (SELECT "attempt" FROM upd), bd."thread_id", (SELECT
    ro."generation" FROM "hermes_sessions_codexrollout" ro WHERE ro."thread_id" = lower(bd."thread_id")) FROM
    (SELECT 1) one LEFT JOIN me ON true LEFT JOIN "hermes_sessions_codexbinding" bd ON bd."session_id" =
    me."session_id" AND bd."status" = %(active)s;

-- name: draw_turn_seq
-- The enqueue's lock and draw: the session's ``last_turn_seq + 1`` and ``updated_at`` (%s, %s: the
-- time, the session). An UPDATE: ``FOR NO KEY UPDATE``'s lock, held to the commit.
UPDATE "hermes_sessions_session" SET "last_turn_seq" = "last_turn_seq" + 1, "updated_at" = %s WHERE "id" = %s;

-- name: draw_turn_seq_owned
-- ``draw_turn_seq`` only when ``owner_id`` is the third parameter (no row otherwise: nothing locked).
UPDATE "hermes_sessions_session" SET "last_turn_seq" = "last_turn_seq" + 1, "updated_at" = %s WHERE "id" = %s
    AND "owner_id" = %s;

-- name: turn_insert
-- A new turn, every column (``turns._TURN_FIELDS`` in order).
INSERT INTO "hermes_sessions_turn" ("id", "session_id", "seq", "status", "input", "thread_action",
    "codex_thread_id", "codex_turn_id", "codex_methods", "final_text", "error", "usage", "timings", "attempt",
    "claim_token", "lease_expires_at", "dispatched_at", "cancel_requested_at", "created_by_id", "created_at",
    "started_at", "finished_at") VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
    %s, %s, %s, %s, %s);

-- name: turn_insert_drawn
-- The one-trip enqueue's turn: its ``seq`` from the session row the draw just locked and its
-- ``created_at`` / ``dispatched_at`` from the clock once the lock was granted (a POST that waited is
-- not overdue at birth: tests/services/test_enqueue_one_trip.py). Parameters: the turn's columns but
-- those three (``turns._TURN_FIELDS`` order), then the session. No session row: no turn.
INSERT INTO "hermes_sessions_turn" ("id", "session_id", "seq", "status", "input", "thread_action",
    "codex_thread_id", "codex_turn_id", "codex_methods", "final_text", "error", "usage", "timings", "attempt",
    "claim_token", "lease_expires_at", "dispatched_at", "cancel_requested_at", "created_by_id", "created_at",
    "started_at", "finished_at") SELECT %s, %s, s."last_turn_seq", %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
    %s, %s, c.now, %s, %s, c.now, %s, %s FROM "hermes_sessions_session" s CROSS JOIN (SELECT clock_timestamp()
    AS now) c WHERE s."id" = %s RETURNING "created_at", "dispatched_at";

-- name: turn_insert_drawn_owned
-- ``turn_insert_drawn`` only into a session whose ``owner_id`` is the last parameter.
INSERT INTO "hermes_sessions_turn" ("id", "session_id", "seq", "status", "input", "thread_action",
    "codex_thread_id", "codex_turn_id", "codex_methods", "final_text", "error", "usage", "timings", "attempt",
    "claim_token", "lease_expires_at", "dispatched_at", "cancel_requested_at", "created_by_id", "created_at",
    "started_at", "finished_at") SELECT %s, %s, s."last_turn_seq", %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
    %s, %s, c.now, %s, %s, c.now, %s, %s FROM "hermes_sessions_session" s CROSS JOIN (SELECT clock_timestamp()
    AS now) c WHERE s."id" = %s AND s."owner_id" = %s RETURNING "created_at", "dispatched_at";

-- name: enqueue_reads
-- The two-trip enqueue's reads after its lock: the drawn ``seq``, the session's running (or else oldest
-- queued) turn — ``'running'`` sorts after ``'queued'``, so ``DESC`` puts it first — and its status,
-- and the route: ``'wake:<queue>'`` (the holder's wake listener listens) or ``'queue:<queue>'``, NULL
-- for none (``routing.parse_route``). Parameters: the session, the two statuses, again, then
-- ``routing.session_route_params``, then the session.
SELECT s."last_turn_seq", (SELECT b."id" FROM "hermes_sessions_turn" b WHERE b."session_id" = %s AND
    b."status" IN (%s, %s) ORDER BY b."status" DESC, b."seq" LIMIT 1), (SELECT b."status" FROM
    "hermes_sessions_turn" b WHERE b."session_id" = %s AND b."status" IN (%s, %s) ORDER BY b."status" DESC,
    b."seq" LIMIT 1), (SELECT CASE WHEN tw."wakeable" THEN 'wake:' ELSE 'queue:' END || w."queue" FROM
    "hermes_sessions_warmthread" w JOIN "hermes_sessions_turnworker" tw ON tw."queue" = w."queue" WHERE
    w."session_id" = %s AND w."until" > %s AND tw."heartbeat_at" > %s LIMIT 1) FROM "hermes_sessions_session"
    s WHERE s."id" = %s;

-- name: enqueue_reads_and_wake
-- The one-trip enqueue's reads after its writes, and its wake, as one statement: ``enqueue_reads``'s
-- columns (the busy turn leaves the new one out: the 4th and 8th parameters) and how many wakes were
-- sent (0 or 1) — ``pg_notify`` on ``routing.wake_channel`` of the route's queue, computed here
-- (``sha256``), with the payload parameter, when the flag parameter allows it, the route is a wakeable
-- worker's, nothing else of the session is running or queued and the new turn exists.
WITH r AS (SELECT s."last_turn_seq" AS seq, (SELECT b."id" FROM "hermes_sessions_turn" b WHERE b."session_id"
    = %s AND b."status" IN (%s, %s) AND b."id" <> %s ORDER BY b."status" DESC, b."seq" LIMIT 1) AS busy_id,
    (SELECT b."status" FROM "hermes_sessions_turn" b WHERE b."session_id" = %s AND b."status" IN (%s, %s) AND
    b."id" <> %s ORDER BY b."status" DESC, b."seq" LIMIT 1) AS busy_status, (SELECT CASE WHEN tw."wakeable"
    THEN 'wake:' ELSE 'queue:' END || w."queue" FROM "hermes_sessions_warmthread" w JOIN
    "hermes_sessions_turnworker" tw ON tw."queue" = w."queue" WHERE w."session_id" = %s AND w."until" > %s AND
    tw."heartbeat_at" > %s LIMIT 1) AS route FROM "hermes_sessions_session" s WHERE s."id" = %s),
n AS (SELECT pg_notify('hermes_wake_' || left(encode(sha256(convert_to(substr(r.route, 6), 'UTF8')), 'hex'),
    20), %s) FROM r WHERE %s AND left(r.route, 5) = 'wake:' AND r.busy_id IS NULL AND EXISTS (SELECT 1 FROM
    "hermes_sessions_turn" WHERE "id" = %s)) SELECT r.seq, r.busy_id, r.busy_status, r.route, (SELECT count(*)
    FROM n) FROM r;


-- ====================================================================================================
-- a turn's end (services/turns.py, services/dispatch.py, services/routing.py)
-- ====================================================================================================

-- name: turn_finish
-- A ended turn's ``turns._FINISH_FIELDS``, by id (the last parameter).
UPDATE "hermes_sessions_turn" SET "status" = %s, "thread_action" = %s, "codex_thread_id" = %s, "codex_turn_id"
    = %s, "codex_methods" = %s, "final_text" = %s, "error" = %s, "usage" = %s, "finished_at" = %s, "timings" =
    %s, "claim_token" = %s, "lease_expires_at" = %s WHERE "id" = %s;

-- name: session_next_turn_dispatch
-- The session's oldest queued turn stamped ``dispatched_at`` (%s, the session, the queued status);
-- its id (no row: none queued).
UPDATE "hermes_sessions_turn" SET "dispatched_at" = %s WHERE "id" = (SELECT "id" FROM "hermes_sessions_turn"
    WHERE "session_id" = %s AND "status" = %s ORDER BY "seq" LIMIT 1) RETURNING "id";

-- name: warm_thread_upsert
-- Worker ``queue`` keeps the session's thread loaded at a generation until a time (session, queue,
-- thread, generation, until).
INSERT INTO "hermes_sessions_warmthread" ("session_id", "queue", "thread_id", "generation", "until") VALUES
    (%s, %s, %s, %s, %s) ON CONFLICT ("session_id") DO UPDATE SET "queue" = EXCLUDED."queue", "thread_id" =
    EXCLUDED."thread_id", "generation" = EXCLUDED."generation", "until" = EXCLUDED."until";

-- name: warm_thread_delete
-- No worker keeps the session's thread (%s: the session).
DELETE FROM "hermes_sessions_warmthread" WHERE "session_id" = %s;

-- name: turn_end_keeping_warm
-- The finalize's last write, one statement: ``turn_finish``, ``warm_thread_upsert``,
-- ``session_next_turn_dispatch`` and the read of the active binding (the session, the active status),
-- in that order of parameters. One row: the next turn's id, the binding's id and thread (NULLs: none).
WITH t AS (UPDATE "hermes_sessions_turn" SET "status" = %s, "thread_action" = %s, "codex_thread_id" = %s,
    "codex_turn_id" = %s, "codex_methods" = %s, "final_text" = %s, "error" = %s, "usage" = %s, "finished_at" =
    %s, "timings" = %s, "claim_token" = %s, "lease_expires_at" = %s WHERE "id" = %s),
w AS (INSERT INTO "hermes_sessions_warmthread" ("session_id", "queue", "thread_id", "generation", "until")
    VALUES (%s, %s, %s, %s, %s) ON CONFLICT ("session_id") DO UPDATE SET "queue" = EXCLUDED."queue",
    "thread_id" = EXCLUDED."thread_id", "generation" = EXCLUDED."generation", "until" = EXCLUDED."until"),
n AS (UPDATE "hermes_sessions_turn" SET "dispatched_at" = %s WHERE "id" = (SELECT "id" FROM
    "hermes_sessions_turn" WHERE "session_id" = %s AND "status" = %s ORDER BY "seq" LIMIT 1) RETURNING "id")
    SELECT (SELECT n."id" FROM n), b."id", b."thread_id" FROM (SELECT 1) one LEFT JOIN
    "hermes_sessions_codexbinding" b ON b."session_id" = %s AND b."status" = %s;

-- name: turn_end_forgetting_warm
-- ``turn_end_keeping_warm`` with ``warm_thread_delete``.
WITH t AS (UPDATE "hermes_sessions_turn" SET "status" = %s, "thread_action" = %s, "codex_thread_id" = %s,
    "codex_turn_id" = %s, "codex_methods" = %s, "final_text" = %s, "error" = %s, "usage" = %s, "finished_at" =
    %s, "timings" = %s, "claim_token" = %s, "lease_expires_at" = %s WHERE "id" = %s),
w AS (DELETE FROM "hermes_sessions_warmthread" WHERE "session_id" = %s),
n AS (UPDATE "hermes_sessions_turn" SET "dispatched_at" = %s WHERE "id" = (SELECT "id" FROM
    "hermes_sessions_turn" WHERE "session_id" = %s AND "status" = %s ORDER BY "seq" LIMIT 1) RETURNING "id")
    SELECT (SELECT n."id" FROM n), b."id", b."thread_id" FROM (SELECT 1) one LEFT JOIN
    "hermes_sessions_codexbinding" b ON b."session_id" = %s AND b."status" = %s;

-- name: messages_append
-- Transcript rows and the session's counter: the session's ``last_message_seq`` and ``updated_at``
-- (then its id), then ``{rows}`` of ``turns._MESSAGE_FIELDS``.
WITH s AS (UPDATE "hermes_sessions_session" SET "last_message_seq" = %s, "updated_at" = %s WHERE "id" = %s)
    INSERT INTO "hermes_sessions_message" ("session_id", "seq", "turn_id", "role", "content", "tool_calls",
    "tool_call_id", "reasoning", "codex_item_id", "created_at") VALUES {rows};

-- name: rollout_store_fenced
-- The rollout header moved from generation ``%(generation)s`` to ``%(next)s``, only if nobody moved it
-- since (generation, length and sha256 as read at the claim); its id (no row: fenced out).
UPDATE "hermes_sessions_codexrollout" SET "length" = %(length)s, "sha256" = %(sha256)s, "generation" =
    %(next)s, "relpath" = %(relpath)s, "codex_version" = %(version)s, "updated_at" = %(now)s WHERE "thread_id"
    = %(thread)s AND "generation" = %(generation)s AND "length" = %(base_length)s AND "sha256" =
    %(base_sha256)s RETURNING "id";

-- name: rollout_store_fenced_with_chunk
-- ``rollout_store_fenced`` and its chunk, inserted from the header's ``RETURNING id``: a fenced-out
-- update inserts nothing and returns no row.
WITH u AS (UPDATE "hermes_sessions_codexrollout" SET "length" = %(length)s, "sha256" = %(sha256)s,
    "generation" = %(next)s, "relpath" = %(relpath)s, "codex_version" = %(version)s, "updated_at" = %(now)s
    WHERE "thread_id" = %(thread)s AND "generation" = %(generation)s AND "length" = %(base_length)s AND
    "sha256" = %(base_sha256)s RETURNING "id") INSERT INTO "hermes_sessions_rolloutchunk" ("rollout_id",
    "seq", "offset", "size", "compression", "data", "sha256", "created_at") SELECT u."id", %(seq)s,
    %(offset)s, %(size)s, %(compression)s, %(data)s, %(chunk_sha256)s, %(now)s FROM u RETURNING "rollout_id";


-- name: rollout_chunks_from
-- Up to %(limit)s chunks of thread %(thread)s's rollout starting at byte %(start)s or later, in file order
-- (offsets grow with seq; index ``rollout_chunk_offset``): the rollout's id, seq, offset, size,
-- compression, sha256, the stored length, and the stored bytes when at most %(slice)s bytes (a larger
-- one is read in slices, ``rollout_chunk_slice``: no row brings more than %(slice)s bytes).
SELECT c."rollout_id", c."seq", c."offset", c."size", c."compression", c."sha256", octet_length(c."data"),
    CASE WHEN octet_length(c."data") <= %(slice)s THEN c."data" END FROM "hermes_sessions_rolloutchunk" c
    WHERE c."rollout_id" = (SELECT r."id" FROM "hermes_sessions_codexrollout" r WHERE r."thread_id" =
    %(thread)s) AND c."offset" >= %(start)s ORDER BY c."offset" LIMIT %(limit)s;

-- name: rollout_chunk_slice
-- %(length)s stored bytes of chunk %(seq)s of rollout %(rollout)s from byte %(from)s (1-based, as SQL's
-- ``substring``).
SELECT substring(c."data" FROM %(from)s FOR %(length)s) FROM "hermes_sessions_rolloutchunk" c WHERE
    c."rollout_id" = %(rollout)s AND c."seq" = %(seq)s;

-- ====================================================================================================
-- events and wake-ups (services/events.py, services/dispatch.py, services/routing.py, listener.py)
-- ====================================================================================================

-- name: events_append
-- A turn's events, one statement: ``l`` locks the session row (``FOR NO KEY UPDATE``, the event lock:
-- ids in commit order within a session, docs/contract.md §8); ``c`` reads the turn through ``l``; the
-- insert draws its ids (in ``ord`` order) once the lock is held; ``HAVING``: no row, no NOTIFY. The
-- NOTIFY's payload is ``'<session> <turn> <last id>'``, sent only when ``%(notify)s`` (false: the caller
-- sends it after the commit, ``events.event_notify_on_commit``). Returns one row, the new ids, or none.
WITH l AS (SELECT "id" FROM "hermes_sessions_session" WHERE "id" = %(session)s FOR NO KEY UPDATE),
c AS (SELECT t."id", t."attempt", t."session_id" FROM "hermes_sessions_turn" t JOIN l ON t."session_id" =
    l."id" WHERE t."id" = %(turn)s),
v (ord, kind, data) AS (VALUES {values}),
e AS (INSERT INTO "hermes_sessions_turnevent" ("session_id", "turn_id", "attempt", "kind", "data",
    "created_at") SELECT c."session_id", c."id", %(attempt)s, v.kind, v.data, %(now)s FROM c CROSS JOIN v
    ORDER BY v.ord RETURNING "id", "session_id") SELECT array_agg(e."id" ORDER BY e."id"),
    CASE WHEN %(notify)s THEN pg_notify(%(channel)s, %(prefix)s || max(e."id")) END FROM e HAVING count(*) > 0;

-- name: events_append_claimed
-- ``events_append`` only while ``%(token)s`` holds the running turn: the check runs under ``FOR SHARE``
-- of the turn row, which conflicts with the ``FOR UPDATE`` that claim, requeue, finalize and the sweep
-- take, and its ``LockRows`` runs only after ``l`` gave its locked row: session row, then turn row (I3).
WITH l AS (SELECT "id" FROM "hermes_sessions_session" WHERE "id" = %(session)s FOR NO KEY UPDATE),
c AS (SELECT t."id", t."attempt", t."session_id" FROM "hermes_sessions_turn" t JOIN l ON t."session_id" =
    l."id" WHERE t."id" = %(turn)s AND t."claim_token" = %(token)s AND t."status" = %(running)s FOR SHARE OF
    t),
v (ord, kind, data) AS (VALUES {values}),
e AS (INSERT INTO "hermes_sessions_turnevent" ("session_id", "turn_id", "attempt", "kind", "data",
    "created_at") SELECT c."session_id", c."id", %(attempt)s, v.kind, v.data, %(now)s FROM c CROSS JOIN v
    ORDER BY v.ord RETURNING "id", "session_id") SELECT array_agg(e."id" ORDER BY e."id"),
    pg_notify(%(channel)s, %(prefix)s || max(e."id")) FROM e HAVING count(*) > 0;

-- name: events_append_of_claim
-- ``events_append_claimed`` in the claim's own round trip: the session is the turn's and the attempt
-- the turn row's as the claim set it, read here (the caller knows neither before the round trip).
WITH l AS (SELECT "id" FROM "hermes_sessions_session" WHERE "id" = (SELECT "session_id" FROM
    "hermes_sessions_turn" WHERE "id" = %(turn)s) FOR NO KEY UPDATE),
c AS (SELECT t."id", t."attempt", t."session_id" FROM "hermes_sessions_turn" t JOIN l ON t."session_id" =
    l."id" WHERE t."id" = %(turn)s AND t."claim_token" = %(token)s AND t."status" = %(running)s FOR SHARE OF
    t),
v (ord, kind, data) AS (VALUES {values}),
e AS (INSERT INTO "hermes_sessions_turnevent" ("session_id", "turn_id", "attempt", "kind", "data",
    "created_at") SELECT c."session_id", c."id", c."attempt", v.kind, v.data, %(now)s FROM c CROSS JOIN v
    ORDER BY v.ord RETURNING "id", "session_id") SELECT array_agg(e."id" ORDER BY e."id"),
    pg_notify(%(channel)s, max(e."session_id") || %(turn_part)s || max(e."id")) FROM e HAVING count(*) > 0;

-- name: events_append_queued
-- The one-trip enqueue's ``queued`` event: ``events_append`` of one row whose data is
-- ``{"seq": <the new turn row's seq>}``, read from the row inserted before it in the same round trip.
WITH l AS (SELECT "id" FROM "hermes_sessions_session" WHERE "id" = %(session)s FOR NO KEY UPDATE),
c AS (SELECT t."id", t."attempt", t."session_id" FROM "hermes_sessions_turn" t JOIN l ON t."session_id" =
    l."id" WHERE t."id" = %(turn)s),
v (ord, kind, data) AS (VALUES (0, %(k0)s, jsonb_build_object('seq', (SELECT "seq" FROM "hermes_sessions_turn"
    WHERE "id" = %(turn)s)))),
e AS (INSERT INTO "hermes_sessions_turnevent" ("session_id", "turn_id", "attempt", "kind", "data",
    "created_at") SELECT c."session_id", c."id", %(attempt)s, v.kind, v.data, %(now)s FROM c CROSS JOIN v
    ORDER BY v.ord RETURNING "id", "session_id") SELECT array_agg(e."id" ORDER BY e."id"),
    pg_notify(%(channel)s, %(prefix)s || max(e."id")) FROM e HAVING count(*) > 0;

-- name: turn_events_after
-- A session's events after an id, oldest first, at most %s (session, after id, limit): the event
-- hub's read on its own connection (columns named as ``event_hub.ROW_FIELDS``).
SELECT "id" AS "id", "turn_id" AS "turn_id", "attempt" AS "attempt", "kind" AS "kind", "data" AS "data" FROM
    "hermes_sessions_turnevent" WHERE "session_id" = %s AND "id" > %s ORDER BY "id" LIMIT %s;

-- name: notify
-- ``pg_notify(channel, payload)``.
SELECT pg_notify(%s, %s);

-- name: listen
-- The listener's ``LISTEN`` on its channel (``listener.py``: psycopg's ``sql.Identifier``).
LISTEN {channel};


-- ====================================================================================================
-- webhooks (services/webhooks.py; the outbox's rows are inserted by migration 0013's trigger)
-- ====================================================================================================

-- name: webhook_deliveries_claim
-- Claim up to %(limit)s due deliveries of active endpoints, oldest due first: the claim's token, and the
-- next attempt moved %(lease)s seconds on (a sender that dies leaves them due again then). ``SKIP LOCKED``:
-- senders never wait for each other. Reads the partial index ``webhook_delivery_due``. Only deliveries
-- the endpoint's owner may still receive: an active user, of their own session or, while staff, any.
-- Returns the ids.
UPDATE "hermes_sessions_webhookdelivery" d SET "claim_token" = %(token)s,
    "next_attempt_at" = now() + make_interval(secs => %(lease)s)
    WHERE d."id" IN (SELECT q."id" FROM "hermes_sessions_webhookdelivery" q JOIN "hermes_sessions_webhookendpoint" w
    ON w."id" = q."endpoint_id" JOIN "auth_user" u ON u."id" = w."owner_id" WHERE q."status" IN ('pending', 'failed')
    AND q."next_attempt_at" <= now() AND w."active" AND u."is_active" AND (u."is_staff" OR EXISTS (SELECT 1 FROM
    "hermes_sessions_session" s WHERE s."id" = q."session_id" AND s."owner_id" = u."id"))
    ORDER BY q."next_attempt_at" LIMIT %(limit)s FOR UPDATE OF q SKIP LOCKED) RETURNING d."id";


-- ====================================================================================================
-- reads, imports, the admin (selectors.py, services/portability.py, services/verbatim.py, admin/pagination.py)
-- ====================================================================================================

-- name: message_search_nodes
-- Whether PostgreSQL can parse %s (a text search configuration) / %s as a web-search query.
SELECT numnode(websearch_to_tsquery(%s::regconfig, %s));

-- name: transaction_repeatable_read
-- An export's one snapshot.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ;

-- name: sequence_catch_up
-- Move a table's serial sequence (table, column) past the largest id inserted with ids of its own,
-- never back (table, column, id, id, table, column).
SELECT setval(pg_get_serial_sequence(%s, %s), %s) WHERE %s >
    COALESCE(pg_sequence_last_value(pg_get_serial_sequence(%s, %s)::regclass), 0);

-- name: table_row_estimate
-- The planner's estimate of a table's rows (%s: the table's name).
SELECT reltuples FROM pg_class WHERE oid = %s::regclass;


-- ====================================================================================================
-- the readiness checks (hermes_sessions/health.py), on their own connection
-- =============================================================================================

-- name: health_ping
-- The database answers: one row (1).
SELECT 1;

-- name: health_applied_migrations
-- Every applied migration: rows of (app, name).
SELECT "app", "name" FROM "django_migrations";

-- name: health_workers
-- The newest worker heartbeats (``WorkerHealth``), newest first: rows of (node, heartbeat_at,
-- sandbox_ok, sandbox_reason); only worker ``%(node)s`` unless it is ''. At most ``%(limit)s`` rows.
SELECT "node", "heartbeat_at", "sandbox_ok", "sandbox_reason" FROM "hermes_sessions_workerhealth" WHERE
    %(node)s = '' OR "node" = %(node)s ORDER BY "heartbeat_at" DESC LIMIT %(limit)s;


-- ====================================================================================================
-- metrics (selectors.metrics_state, selectors.metrics_queues: GET /metrics at each scrape)
-- ====================================================================================================

-- name: metrics_state
-- One row of counts (each an index or partial-index scan): turns queued, turns running, running turns
-- whose lease expired by the database's clock, unacknowledged notices, pending approvals, workers whose
-- heartbeat is after %s (now − HERMES_WORKER_STALE_SECONDS), warm threads whose window is open.
SELECT
    (SELECT count(*) FROM "hermes_sessions_turn" WHERE "status" = 'queued'),
    (SELECT count(*) FROM "hermes_sessions_turn" WHERE "status" = 'running'),
    (SELECT count(*) FROM "hermes_sessions_turn" WHERE "status" = 'running' AND "lease_expires_at" < now()),
    (SELECT count(*) FROM "hermes_sessions_notice" WHERE "acknowledged_at" IS NULL),
    (SELECT count(*) FROM "hermes_sessions_approval" WHERE "status" = 'pending'),
    (SELECT count(*) FROM "hermes_sessions_turnworker" WHERE "heartbeat_at" > %s),
    (SELECT count(*) FROM "hermes_sessions_warmthread" WHERE "until" > now());

-- name: metrics_queues
-- Queued turns per queue they go to, and the age (seconds, by the database's clock) of the oldest: the
-- route of the worker keeping the session's thread loaded (window open, heartbeat fresh), else
-- HERMES_TURN_QUEUE. Takes HERMES_TURN_QUEUE, then now − HERMES_WORKER_STALE_SECONDS. Rows: queue,
-- depth, oldest age.
SELECT COALESCE(w."queue", %s) AS "queue", count(*),
    EXTRACT(EPOCH FROM now() - min(t."created_at"))::float8
FROM "hermes_sessions_turn" t
LEFT JOIN "hermes_sessions_warmthread" w ON w."session_id" = t."session_id" AND w."until" > now()
    AND EXISTS (SELECT 1 FROM "hermes_sessions_turnworker" k WHERE k."queue" = w."queue" AND k."heartbeat_at" > %s)
WHERE t."status" = 'queued'
GROUP BY 1
ORDER BY 1;
