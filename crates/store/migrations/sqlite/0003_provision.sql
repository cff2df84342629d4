-- kici-scaler state, SQLite flavour: external provisioning (type: event
-- scalers). Keep in step with ../postgres (the schema_match test compares the
-- two). Additive: no existing table changes.
--
-- provision_claims: one row per claim code issued. Only the code's SHA-256
-- (hex) is stored, never the code. A redemption sets consumed_at in one
-- conditional UPDATE, so of concurrent redemptions (on several daemons
-- sharing the store too) exactly one succeeds. Rows of an agent are deleted
-- when it is destroyed; consumed or expired rows are purged later.
-- labels is a JSON array (TEXT); times are unix milliseconds.

CREATE TABLE provision_claims (
    code_hash          TEXT   NOT NULL PRIMARY KEY,
    owner              TEXT   NOT NULL,
    agent_id           TEXT   NOT NULL,
    scaler             TEXT   NOT NULL,
    labels             TEXT   NOT NULL,
    gateway_url        TEXT   NOT NULL,
    agent_token_ttl_ms BIGINT NOT NULL,
    issued_at          BIGINT NOT NULL,
    expires_at         BIGINT NOT NULL,
    consumed_at        BIGINT
);

CREATE INDEX provision_claims_agent ON provision_claims (owner, agent_id);

-- provision_outbox: every scale-up and scale-down event, recorded before it
-- is delivered; delivered_at is set once the provisioner confirmed it. A
-- scale-up's body never holds its claim code (it is re-derived from the
-- daemon's claim key for a redelivery). An agent's rows go once its
-- scale-down is confirmed; a scale-up row without a confirmed scale-down is
-- an instance the reconciler still has to tear down.

CREATE TABLE provision_outbox (
    owner        TEXT   NOT NULL,
    request_id   TEXT   NOT NULL,
    agent_id     TEXT   NOT NULL,
    kind         TEXT   NOT NULL,
    body         TEXT   NOT NULL,
    created_at   BIGINT NOT NULL,
    delivered_at BIGINT,
    PRIMARY KEY (owner, request_id)
);
