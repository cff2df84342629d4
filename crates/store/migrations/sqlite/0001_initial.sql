-- kici-scaler state, SQLite flavour. Keep in step with ../postgres: the
-- schema_match test compares the two (types spelled the same way, so only
-- affinity-level differences are normalised).
-- Times are unix milliseconds (BIGINT); JSON is TEXT.

CREATE TABLE instances (
    owner        TEXT    NOT NULL PRIMARY KEY,
    hostname     TEXT    NOT NULL,
    started_at   BIGINT  NOT NULL,
    heartbeat_at BIGINT  NOT NULL
);

CREATE TABLE agents (
    agent_id         TEXT    NOT NULL PRIMARY KEY,
    owner            TEXT    NOT NULL,
    scaler           TEXT    NOT NULL,
    backend          TEXT    NOT NULL,
    label_set_index  BIGINT  NOT NULL,
    label_set_key    TEXT    NOT NULL,
    state            TEXT    NOT NULL,
    mode             TEXT    NOT NULL,
    job_id           TEXT,
    run_id           TEXT,
    warm             BOOLEAN NOT NULL,
    milli_cpu        BIGINT  NOT NULL,
    memory_bytes     BIGINT  NOT NULL,
    machine_pool     TEXT,
    resource_id      TEXT,
    resources        TEXT    NOT NULL,
    token_hash       TEXT,
    token_expires_at BIGINT,
    failure          TEXT,
    created_at       BIGINT  NOT NULL,
    updated_at       BIGINT  NOT NULL
);
CREATE INDEX agents_owner ON agents (owner, created_at);

CREATE TABLE pending_requests (
    owner      TEXT   NOT NULL,
    job_id     TEXT   NOT NULL,
    labels     TEXT   NOT NULL,
    request    TEXT   NOT NULL,
    run_id     TEXT,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (owner, job_id)
);

-- Networks whose every assignable address has a row in ip_leases.
CREATE TABLE ip_networks (
    network   TEXT   NOT NULL PRIMARY KEY,
    capacity  BIGINT NOT NULL,
    filled_at BIGINT NOT NULL
);

-- One row per assignable address (ip as its u32 value), free while agent_id
-- is NULL. The primary key makes (network, ip) unique; the unique index
-- gives an agent at most one address per network. The leased-row indexes
-- are partial (IS NOT NULL) so that neither is a candidate for the
-- free-address search, which must walk ip_leases_free in ip order (SQLite
-- otherwise picks ip_leases_agent and sorts every free row per claim).
CREATE TABLE ip_leases (
    network   TEXT   NOT NULL,
    ip        BIGINT NOT NULL,
    agent_id  TEXT,
    owner     TEXT,
    leased_at BIGINT,
    PRIMARY KEY (network, ip)
);
CREATE UNIQUE INDEX ip_leases_agent ON ip_leases (network, agent_id) WHERE agent_id IS NOT NULL;
CREATE INDEX ip_leases_owner ON ip_leases (owner, agent_id) WHERE owner IS NOT NULL;
CREATE INDEX ip_leases_free ON ip_leases (network, ip) WHERE agent_id IS NULL;

CREATE TABLE events (
    owner TEXT   NOT NULL,
    seq   BIGINT NOT NULL,
    at    BIGINT NOT NULL,
    body  TEXT   NOT NULL,
    PRIMARY KEY (owner, seq)
);
