-- The fleet's coordination tables (kici-fleet). Additive from here on: a
-- later migration adds columns or tables, never drops or renames one, so
-- hosts one version behind keep working during a rolling upgrade.
-- Times are unix milliseconds (BIGINT) on the database's clock
-- (fleet_now_ms), never a host's; JSON is TEXT.

CREATE FUNCTION fleet_now_ms() RETURNS BIGINT
    LANGUAGE sql VOLATILE
    AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT $$;

-- One row per fleet: the fleet-wide (global) caps, and the row claims lock
-- when a global cap is set, which serialises them fleet-wide.
CREATE TABLE fleet_fleets (
    fleet        TEXT   NOT NULL PRIMARY KEY,
    max_agents   BIGINT,
    max_cpu      BIGINT,
    max_memory   BIGINT,
    leader       TEXT,
    leader_since BIGINT,
    created_at   BIGINT NOT NULL,
    updated_at   BIGINT NOT NULL
);

-- One row per host (daemon) that ever joined. state: up | leaving | left | lost.
CREATE TABLE fleet_hosts (
    fleet            TEXT   NOT NULL,
    instance_id      TEXT   NOT NULL,
    hostname         TEXT   NOT NULL,
    url              TEXT,
    version          TEXT   NOT NULL,
    state            TEXT   NOT NULL,
    epoch            BIGINT NOT NULL,
    lease_ms         BIGINT NOT NULL,
    lease_expires_at BIGINT NOT NULL,
    renewed_at       BIGINT NOT NULL,
    joined_at        BIGINT NOT NULL,
    left_at          BIGINT,
    caps             TEXT   NOT NULL,
    free             TEXT   NOT NULL,
    PRIMARY KEY (fleet, instance_id)
);

-- The pools a host serves, each with its definition and fingerprint, and
-- the host's own agent capacity in it (not part of the definition).
CREATE TABLE fleet_host_pools (
    fleet          TEXT   NOT NULL,
    instance_id    TEXT   NOT NULL,
    pool           TEXT   NOT NULL,
    fingerprint    TEXT   NOT NULL,
    definition     TEXT   NOT NULL,
    host_max_agents BIGINT,
    PRIMARY KEY (fleet, instance_id, pool)
);
CREATE INDEX fleet_host_pools_pool ON fleet_host_pools (fleet, pool);

-- One row per pool: its fleet caps (from the agreed definition), and the
-- row every claim in the pool locks, which serialises them per pool.
CREATE TABLE fleet_pools (
    fleet        TEXT   NOT NULL,
    pool         TEXT   NOT NULL,
    fingerprint  TEXT   NOT NULL,
    definition   TEXT   NOT NULL,
    max_agents   BIGINT,
    max_cpu      BIGINT,
    max_memory   BIGINT,
    updated_at   BIGINT NOT NULL,
    PRIMARY KEY (fleet, pool)
);

-- Arrival order across the whole database; a returned request keeps its
-- value, so it goes back to its original place.
CREATE SEQUENCE fleet_request_seq;
-- Claim order; within a pool it follows arrival order (claims of a pool are
-- serialised by the pool row).
CREATE SEQUENCE fleet_claim_seq;

-- The queue. state: queued | claimed | started | lost | finished.
CREATE TABLE fleet_requests (
    fleet        TEXT   NOT NULL,
    job_id       TEXT   NOT NULL,
    seq          BIGINT NOT NULL DEFAULT nextval('fleet_request_seq'),
    kind         TEXT   NOT NULL,
    pool         TEXT   NOT NULL,
    body         TEXT   NOT NULL,
    answer       TEXT   NOT NULL,
    milli_cpu    BIGINT NOT NULL,
    memory_bytes BIGINT NOT NULL,
    entry_host   TEXT   NOT NULL,
    state        TEXT   NOT NULL,
    arrived_at   BIGINT NOT NULL,
    claimed_by   TEXT,
    claim_epoch  BIGINT,
    claim_seq    BIGINT,
    claimed_at   BIGINT,
    claims       BIGINT NOT NULL DEFAULT 0,
    agent_id     TEXT,
    started_at   BIGINT,
    finished_at  BIGINT,
    outcome      TEXT,
    PRIMARY KEY (fleet, job_id)
);
CREATE INDEX fleet_requests_queued ON fleet_requests (fleet, pool, seq) WHERE state = 'queued';
CREATE INDEX fleet_requests_claimed ON fleet_requests (fleet, pool) WHERE state = 'claimed';
CREATE INDEX fleet_requests_finished ON fleet_requests (fleet, finished_at) WHERE state = 'finished';

-- Agents started for claims. state: live | gone | lost.
CREATE TABLE fleet_agents (
    fleet        TEXT   NOT NULL,
    agent_id     TEXT   NOT NULL,
    instance_id  TEXT   NOT NULL,
    epoch        BIGINT NOT NULL,
    pool         TEXT   NOT NULL,
    job_id       TEXT,
    milli_cpu    BIGINT NOT NULL,
    memory_bytes BIGINT NOT NULL,
    state        TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    updated_at   BIGINT NOT NULL,
    PRIMARY KEY (fleet, agent_id)
);
CREATE INDEX fleet_agents_live ON fleet_agents (fleet, pool) WHERE state = 'live';
CREATE INDEX fleet_agents_host ON fleet_agents (fleet, instance_id) WHERE state = 'live';
