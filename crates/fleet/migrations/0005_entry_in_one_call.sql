-- The entry path in one call. A request entering through a host that
-- serves its pool is written and — if it is its pool's head and the fleet
-- caps admit it — started with the entry host's agent, in one statement:
-- the pool's row (which every entry and claim of the pool serialises on)
-- is held for the function's run instead of one client round trip per
-- statement. The same steps, in the same lock order, as the transaction it
-- replaces: the fleet's row (only when a global cap is set), the pool's
-- row, the request, the host's row (shared: the fence).
--
-- Returns ('existing', NULL) when a request with the job id is in the fleet
-- and not finished (the caller reads it), ('started', seq), ('queued', seq),
-- or ('claimed-head', seq, the head's columns) when older requests wait and
-- this host claimed the oldest of them instead (the caller serves it). A host that is not `up` under `ep` with an unexpired
-- lease raises SQLSTATE KF001 (the statement, its insert included, rolls
-- back), its current epoch as the DETAIL when its lease is valid.
-- Whether one more request of `c` milli-CPU and `m` bytes fits under caps
-- (NULL: none) given what is used.
CREATE FUNCTION fleet_fits(max_agents BIGINT, max_cpu BIGINT, max_memory BIGINT,
                           used_agents BIGINT, used_cpu BIGINT, used_memory BIGINT,
                           c BIGINT, m BIGINT) RETURNS BOOLEAN
LANGUAGE sql IMMUTABLE AS $$
    SELECT (max_agents IS NULL OR used_agents + 1 <= max_agents)
       AND (max_cpu IS NULL OR used_cpu + c <= max_cpu)
       AND (max_memory IS NULL OR used_memory + m <= max_memory)
$$;

CREATE FUNCTION fleet_enter(
    f TEXT, j TEXT, k TEXT, p TEXT, b TEXT, ans TEXT, c BIGINT, m BIGINT,
    entry TEXT, sec TEXT, inst TEXT, ep BIGINT, ag TEXT, channel TEXT)
RETURNS TABLE (outcome TEXT, seq BIGINT, head_job_id TEXT, head_seq BIGINT, head_kind TEXT,
               head_body TEXT, head_secret TEXT, head_milli_cpu BIGINT, head_memory_bytes BIGINT,
               head_arrived_at BIGINT, head_claim_seq BIGINT)
LANGUAGE plpgsql AS $$
DECLARE
    g_agents BIGINT; g_cpu BIGINT; g_memory BIGINT;
    global_cap BOOLEAN;
    p_agents BIGINT; p_cpu BIGINT; p_memory BIGINT;
    u_agents BIGINT; u_cpu BIGINT; u_memory BIGINT;
    f_agents BIGINT := 0; f_cpu BIGINT := 0; f_memory BIGINT := 0;
    pool_known BOOLEAN;
    s BIGINT;
    h_epoch BIGINT; h_valid BOOLEAN;
    older BOOLEAN;
    head fleet_requests%ROWTYPE;
    cs BIGINT;
BEGIN
    -- A repeat of a request still in the fleet (a client's retry, the same
    -- job through a second host) is answered before any lock: the insert
    -- below, under the pool's row, would wait on the request's row, the
    -- reverse of the order in which starting or completing that request
    -- takes them (its row, then the pool's through the usage trigger).
    IF EXISTS (SELECT 1 FROM fleet_requests q WHERE q.fleet = f AND q.job_id = j AND q.state <> 'finished') THEN
        RETURN QUERY SELECT 'existing'::TEXT, NULL::BIGINT, NULL::TEXT, NULL::BIGINT, NULL::TEXT,
            NULL::TEXT, NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
        RETURN;
    END IF;
    SELECT max_agents, max_cpu, max_memory INTO g_agents, g_cpu, g_memory
      FROM fleet_fleets WHERE fleet = f;
    global_cap := g_agents IS NOT NULL OR g_cpu IS NOT NULL OR g_memory IS NOT NULL;
    IF global_cap THEN
        SELECT max_agents, max_cpu, max_memory INTO g_agents, g_cpu, g_memory
          FROM fleet_fleets WHERE fleet = f FOR UPDATE;
    END IF;
    SELECT max_agents, max_cpu, max_memory, used_agents, used_cpu, used_memory
      INTO p_agents, p_cpu, p_memory, u_agents, u_cpu, u_memory
      FROM fleet_pools WHERE fleet = f AND pool = p FOR UPDATE;
    pool_known := FOUND;

    INSERT INTO fleet_requests AS r (fleet, job_id, kind, pool, body, answer, milli_cpu, memory_bytes,
                                     entry_host, secret, state, arrived_at)
    VALUES (f, j, k, p, b, ans, c, m, entry, sec, 'queued', fleet_now_ms())
    ON CONFLICT (fleet, job_id) DO UPDATE SET seq = nextval('fleet_request_seq'),
        pool = EXCLUDED.pool, secret = EXCLUDED.secret, answer = EXCLUDED.answer,
        milli_cpu = EXCLUDED.milli_cpu, memory_bytes = EXCLUDED.memory_bytes,
        entry_host = EXCLUDED.entry_host, state = 'queued', arrived_at = fleet_now_ms(),
        claimed_by = NULL, claim_epoch = NULL, claim_seq = NULL, claimed_at = NULL,
        agent_id = NULL, started_at = NULL, finished_at = NULL, outcome = NULL
      WHERE r.state = 'finished' AND r.body = EXCLUDED.body
    RETURNING r.seq INTO s;
    IF s IS NULL THEN
        RETURN QUERY SELECT 'existing'::TEXT, NULL::BIGINT, NULL::TEXT, NULL::BIGINT, NULL::TEXT,
            NULL::TEXT, NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
        RETURN;
    END IF;

    IF pool_known THEN
        SELECT h.epoch, h.state = 'up' AND h.lease_expires_at > fleet_now_ms()
          INTO h_epoch, h_valid
          FROM fleet_hosts h WHERE h.fleet = f AND h.instance_id = inst FOR SHARE;
        IF NOT FOUND OR NOT h_valid OR h_epoch <> ep THEN
            RAISE EXCEPTION 'host % is not up under epoch %', inst, ep
                USING ERRCODE = 'KF001',
                      DETAIL = CASE WHEN h_valid THEN h_epoch::TEXT ELSE '' END;
        END IF;
        IF global_cap THEN
            SELECT COALESCE(sum(used_agents), 0), COALESCE(sum(used_cpu), 0), COALESCE(sum(used_memory), 0)
              INTO f_agents, f_cpu, f_memory
              FROM fleet_pools WHERE fleet = f;
        END IF;
        older := EXISTS (SELECT 1 FROM fleet_requests q
                          WHERE q.fleet = f AND q.pool = p AND q.state = 'queued' AND q.seq < s);
        IF NOT older THEN
            IF fleet_fits(p_agents, p_cpu, p_memory, u_agents, u_cpu, u_memory, c, m)
               AND fleet_fits(g_agents, g_cpu, g_memory, f_agents, f_cpu, f_memory, c, m) THEN
                UPDATE fleet_requests SET state = 'started', claimed_by = inst, claim_epoch = ep,
                       claim_seq = nextval('fleet_claim_seq'), claimed_at = fleet_now_ms(), claims = claims + 1,
                       agent_id = ag, started_at = fleet_now_ms()
                 WHERE fleet = f AND job_id = j;
                INSERT INTO fleet_agents (fleet, agent_id, instance_id, epoch, pool, job_id, milli_cpu, memory_bytes,
                                          state, created_at, updated_at)
                VALUES (f, ag, inst, ep, p, j, c, m, 'live', fleet_now_ms(), fleet_now_ms());
                IF EXISTS (SELECT 1 FROM fleet_requests q WHERE q.fleet = f AND q.pool = p AND q.state = 'queued') THEN
                    PERFORM pg_notify(channel, json_build_array(f, p)::TEXT);
                END IF;
                RETURN QUERY SELECT 'started'::TEXT, s, NULL::TEXT, NULL::BIGINT, NULL::TEXT,
                    NULL::TEXT, NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
                RETURN;
            END IF;
        ELSE
            -- Older requests wait: this one queues behind them (FIFO), and
            -- this host, which has room, claims the pool's head instead —
            -- while arrivals keep coming, the queue drains at the entries'
            -- pace rather than only at the claim loops' wake-ups.
            SELECT * INTO head FROM fleet_requests q
             WHERE q.fleet = f AND q.pool = p AND q.state = 'queued'
             ORDER BY q.seq LIMIT 1 FOR UPDATE SKIP LOCKED;
            IF FOUND
               AND fleet_fits(p_agents, p_cpu, p_memory, u_agents, u_cpu, u_memory,
                              head.milli_cpu, head.memory_bytes)
               AND fleet_fits(g_agents, g_cpu, g_memory, f_agents, f_cpu, f_memory,
                              head.milli_cpu, head.memory_bytes) THEN
                UPDATE fleet_requests r SET state = 'claimed', claimed_by = inst, claim_epoch = ep,
                       claim_seq = nextval('fleet_claim_seq'), claimed_at = fleet_now_ms(), claims = r.claims + 1
                 WHERE r.fleet = f AND r.job_id = head.job_id
                RETURNING r.claim_seq INTO cs;
                PERFORM pg_notify(channel, json_build_array(f, p)::TEXT);
                RETURN QUERY SELECT 'claimed-head'::TEXT, s, head.job_id, head.seq, head.kind,
                    head.body, head.secret, head.milli_cpu, head.memory_bytes, head.arrived_at, cs;
                RETURN;
            END IF;
        END IF;
    END IF;

    PERFORM pg_notify(channel, json_build_array(f, p)::TEXT);
    RETURN QUERY SELECT 'queued'::TEXT, s, NULL::TEXT, NULL::BIGINT, NULL::TEXT,
        NULL::TEXT, NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
END
$$;

-- A claim in one call, for the same reason: the oldest queued request of
-- pool `p`, claimed by `inst` under `ep` if the fleet caps admit it. Lock
-- order as above; the pool's row is waited for at most `wait` (a host's
-- claim gives up rather than hold one of its few connections while every
-- host of the pool queues on that row: SQLSTATE 55P03, nothing changed).
-- Returns one row: ('claimed', the request's columns), or ('empty') /
-- ('at-cap') with NULLs. The fence raises KF001 as in fleet_enter. When
-- requests still wait after a claim (or a start at entry), the pool's hosts
-- are notified: the claim changed this host's load, so a host placement
-- passed over a moment ago may be the one to claim now, and nothing else
-- would wake it before its fallback poll.
CREATE FUNCTION fleet_claim(f TEXT, p TEXT, inst TEXT, ep BIGINT, channel TEXT, wait TEXT)
RETURNS TABLE (outcome TEXT, job_id TEXT, seq BIGINT, kind TEXT, body TEXT, secret TEXT,
               milli_cpu BIGINT, memory_bytes BIGINT, arrived_at BIGINT, claim_seq BIGINT)
LANGUAGE plpgsql AS $$
DECLARE
    g_agents BIGINT; g_cpu BIGINT; g_memory BIGINT;
    global_cap BOOLEAN;
    p_agents BIGINT; p_cpu BIGINT; p_memory BIGINT;
    u_agents BIGINT; u_cpu BIGINT; u_memory BIGINT;
    h_epoch BIGINT; h_valid BOOLEAN;
    head fleet_requests%ROWTYPE;
    cs BIGINT;
BEGIN
    -- Woken with every host of the pool, most find the queue already empty:
    -- they leave without waiting for the pool's row (a request that arrives
    -- right after this read notifies them again at its commit).
    IF NOT EXISTS (SELECT 1 FROM fleet_requests q WHERE q.fleet = f AND q.pool = p AND q.state = 'queued') THEN
        RETURN QUERY SELECT 'empty'::TEXT, NULL::TEXT, NULL::BIGINT, NULL::TEXT, NULL::TEXT,
            NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', wait, true);
    SELECT max_agents, max_cpu, max_memory INTO g_agents, g_cpu, g_memory
      FROM fleet_fleets WHERE fleet = f;
    global_cap := g_agents IS NOT NULL OR g_cpu IS NOT NULL OR g_memory IS NOT NULL;
    IF global_cap THEN
        SELECT max_agents, max_cpu, max_memory INTO g_agents, g_cpu, g_memory
          FROM fleet_fleets WHERE fleet = f FOR UPDATE;
    END IF;
    SELECT max_agents, max_cpu, max_memory, used_agents, used_cpu, used_memory
      INTO p_agents, p_cpu, p_memory, u_agents, u_cpu, u_memory
      FROM fleet_pools WHERE fleet = f AND pool = p FOR UPDATE;
    IF NOT FOUND THEN
        -- No host ever defined the pool: nobody may claim in it.
        RETURN QUERY SELECT 'empty'::TEXT, NULL::TEXT, NULL::BIGINT, NULL::TEXT, NULL::TEXT,
            NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
        RETURN;
    END IF;
    SELECT h.epoch, h.state = 'up' AND h.lease_expires_at > fleet_now_ms()
      INTO h_epoch, h_valid
      FROM fleet_hosts h WHERE h.fleet = f AND h.instance_id = inst FOR SHARE;
    IF NOT FOUND OR NOT h_valid OR h_epoch <> ep THEN
        RAISE EXCEPTION 'host % is not up under epoch %', inst, ep
            USING ERRCODE = 'KF001',
                  DETAIL = CASE WHEN h_valid THEN h_epoch::TEXT ELSE '' END;
    END IF;
    SELECT * INTO head FROM fleet_requests q
     WHERE q.fleet = f AND q.pool = p AND q.state = 'queued'
     ORDER BY q.seq LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'empty'::TEXT, NULL::TEXT, NULL::BIGINT, NULL::TEXT, NULL::TEXT,
            NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
        RETURN;
    END IF;
    IF NOT fleet_fits(p_agents, p_cpu, p_memory, u_agents, u_cpu, u_memory,
                      head.milli_cpu, head.memory_bytes) THEN
        RETURN QUERY SELECT 'at-cap'::TEXT, NULL::TEXT, NULL::BIGINT, NULL::TEXT, NULL::TEXT,
            NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
        RETURN;
    END IF;
    IF global_cap THEN
        SELECT COALESCE(sum(used_agents), 0), COALESCE(sum(used_cpu), 0), COALESCE(sum(used_memory), 0)
          INTO u_agents, u_cpu, u_memory
          FROM fleet_pools WHERE fleet = f;
        IF NOT fleet_fits(g_agents, g_cpu, g_memory, u_agents, u_cpu, u_memory,
                          head.milli_cpu, head.memory_bytes) THEN
            RETURN QUERY SELECT 'at-cap'::TEXT, NULL::TEXT, NULL::BIGINT, NULL::TEXT, NULL::TEXT,
                NULL::TEXT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT, NULL::BIGINT;
            RETURN;
        END IF;
    END IF;
    UPDATE fleet_requests r SET state = 'claimed', claimed_by = inst, claim_epoch = ep,
           claim_seq = nextval('fleet_claim_seq'), claimed_at = fleet_now_ms(), claims = r.claims + 1
     WHERE r.fleet = f AND r.job_id = head.job_id
    RETURNING r.claim_seq INTO cs;
    IF EXISTS (SELECT 1 FROM fleet_requests q WHERE q.fleet = f AND q.pool = p AND q.state = 'queued') THEN
        PERFORM pg_notify(channel, json_build_array(f, p)::TEXT);
    END IF;
    RETURN QUERY SELECT 'claimed'::TEXT, head.job_id, head.seq, head.kind, head.body, head.secret,
        head.milli_cpu, head.memory_bytes, head.arrived_at, cs;
END
$$;
