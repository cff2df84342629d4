-- kici-scaler state, SQLite flavour: standalone jobs. Keep in step with
-- ../postgres (the schema_match test compares the two).
--
-- One row per standalone job (POST /v1/jobs) this instance still shows:
-- written before the job is acknowledged, rewritten at every change of
-- state, deleted when the job is forgotten. After a crash, a job that had
-- not ended is shown ended (aborted) with why, instead of vanishing. The
-- command's environment is never stored (it may carry secrets); output is
-- not here (the daemon spools it to files in its state dir).
-- labels and command are JSON arrays (TEXT); end_kind, exit_code, signal
-- and reason are set once the job ended.

CREATE TABLE jobs (
    owner         TEXT   NOT NULL,
    job_id        TEXT   NOT NULL,
    labels        TEXT   NOT NULL,
    command       TEXT   NOT NULL,
    state         TEXT   NOT NULL,
    agent_id      TEXT,
    end_kind      TEXT,
    exit_code     BIGINT,
    signal        BIGINT,
    reason        TEXT,
    output_bytes  BIGINT NOT NULL,
    dropped_bytes BIGINT NOT NULL,
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL,
    PRIMARY KEY (owner, job_id)
);
