-- What a request carries that must not outlive it: a standalone job's
-- environment (its secrets, often). Read by the host that claims the
-- request, erased when the request finishes, never part of the dedupe
-- comparison of bodies.
ALTER TABLE fleet_requests ADD COLUMN secret TEXT;
