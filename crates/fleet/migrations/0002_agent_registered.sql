-- When the agent of a started request registered (NULL: not yet). The
-- leader serves a lost host's request again only if its agent never
-- registered: a registered agent's job belongs to the orchestrator.
ALTER TABLE fleet_agents ADD COLUMN registered_at BIGINT;
