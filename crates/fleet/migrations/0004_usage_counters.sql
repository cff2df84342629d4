-- A pool's usage (its claimed requests plus its live agents: what the caps
-- count) kept as counters on the pool's row, so that a claim reads three
-- numbers instead of summing over every live agent of the pool.
--
-- Triggers keep them exact: every insert, update or delete of a request or
-- an agent row adds its difference in the same transaction, whichever code
-- (of this version or an older one, during a rolling upgrade) made the
-- change. The fleet-wide usage is the sum over the fleet's pools; a host's
-- load in a pool (placement's input) is counted the same way on its
-- `fleet_host_pools` row.

ALTER TABLE fleet_pools
    ADD COLUMN used_agents BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN used_cpu    BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN used_memory BIGINT NOT NULL DEFAULT 0;

ALTER TABLE fleet_host_pools
    ADD COLUMN used_agents BIGINT NOT NULL DEFAULT 0;

-- The pool's row first, then the host's: the order a claim locks them in.
CREATE FUNCTION fleet_usage_add(f TEXT, p TEXT, h TEXT, n BIGINT, c BIGINT, m BIGINT) RETURNS void
LANGUAGE sql AS $$
    UPDATE fleet_pools
       SET used_agents = used_agents + n, used_cpu = used_cpu + c, used_memory = used_memory + m
     WHERE fleet = f AND pool = p;
    UPDATE fleet_host_pools SET used_agents = used_agents + n
     WHERE fleet = f AND pool = p AND instance_id = h;
$$;

-- A request counts while it is `claimed` (once started, its agent counts).
CREATE FUNCTION fleet_requests_usage() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.state = 'claimed' THEN
        PERFORM fleet_usage_add(OLD.fleet, OLD.pool, OLD.claimed_by, -1, -OLD.milli_cpu, -OLD.memory_bytes);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.state = 'claimed' THEN
        PERFORM fleet_usage_add(NEW.fleet, NEW.pool, NEW.claimed_by, 1, NEW.milli_cpu, NEW.memory_bytes);
    END IF;
    RETURN NULL;
END
$$;

-- An agent counts while it is `live`.
CREATE FUNCTION fleet_agents_usage() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.state = 'live' THEN
        PERFORM fleet_usage_add(OLD.fleet, OLD.pool, OLD.instance_id, -1, -OLD.milli_cpu, -OLD.memory_bytes);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.state = 'live' THEN
        PERFORM fleet_usage_add(NEW.fleet, NEW.pool, NEW.instance_id, 1, NEW.milli_cpu, NEW.memory_bytes);
    END IF;
    RETURN NULL;
END
$$;

-- Only changes that can move a count fire (a registration, a heartbeat of
-- a row's other columns do not).
CREATE TRIGGER fleet_requests_usage
    AFTER INSERT OR DELETE OR UPDATE OF state, pool, claimed_by, milli_cpu, memory_bytes ON fleet_requests
    FOR EACH ROW EXECUTE FUNCTION fleet_requests_usage();

CREATE TRIGGER fleet_agents_usage
    AFTER INSERT OR DELETE OR UPDATE OF state, pool, instance_id, milli_cpu, memory_bytes ON fleet_agents
    FOR EACH ROW EXECUTE FUNCTION fleet_agents_usage();

-- A pool row made after its requests (they outlived an earlier definition)
-- starts from what they hold now.
CREATE FUNCTION fleet_pools_initial_usage() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT count(*), COALESCE(sum(milli_cpu), 0), COALESCE(sum(memory_bytes), 0)
      INTO NEW.used_agents, NEW.used_cpu, NEW.used_memory
      FROM (SELECT milli_cpu, memory_bytes FROM fleet_requests
             WHERE fleet = NEW.fleet AND pool = NEW.pool AND state = 'claimed'
            UNION ALL
            SELECT milli_cpu, memory_bytes FROM fleet_agents
             WHERE fleet = NEW.fleet AND pool = NEW.pool AND state = 'live') u;
    RETURN NEW;
END
$$;

CREATE TRIGGER fleet_pools_initial_usage
    BEFORE INSERT ON fleet_pools
    FOR EACH ROW EXECUTE FUNCTION fleet_pools_initial_usage();

-- A host's pool rows are written anew at every join.
CREATE FUNCTION fleet_host_pools_initial_usage() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT (SELECT count(*) FROM fleet_requests
             WHERE fleet = NEW.fleet AND pool = NEW.pool AND state = 'claimed'
               AND claimed_by = NEW.instance_id)
         + (SELECT count(*) FROM fleet_agents
             WHERE fleet = NEW.fleet AND pool = NEW.pool AND state = 'live'
               AND instance_id = NEW.instance_id)
      INTO NEW.used_agents;
    RETURN NEW;
END
$$;

CREATE TRIGGER fleet_host_pools_initial_usage
    BEFORE INSERT ON fleet_host_pools
    FOR EACH ROW EXECUTE FUNCTION fleet_host_pools_initial_usage();

-- The pools as they are now.
UPDATE fleet_pools p
   SET used_agents = u.n, used_cpu = u.cpu, used_memory = u.mem
  FROM (SELECT fleet, pool, count(*) AS n, COALESCE(sum(milli_cpu), 0) AS cpu,
               COALESCE(sum(memory_bytes), 0) AS mem
          FROM (SELECT fleet, pool, milli_cpu, memory_bytes FROM fleet_requests WHERE state = 'claimed'
                UNION ALL
                SELECT fleet, pool, milli_cpu, memory_bytes FROM fleet_agents WHERE state = 'live') x
         GROUP BY fleet, pool) u
 WHERE p.fleet = u.fleet AND p.pool = u.pool;

UPDATE fleet_host_pools hp
   SET used_agents = (SELECT count(*) FROM fleet_requests r
                       WHERE r.fleet = hp.fleet AND r.pool = hp.pool AND r.state = 'claimed'
                         AND r.claimed_by = hp.instance_id)
                   + (SELECT count(*) FROM fleet_agents a
                       WHERE a.fleet = hp.fleet AND a.pool = hp.pool AND a.state = 'live'
                         AND a.instance_id = hp.instance_id);
