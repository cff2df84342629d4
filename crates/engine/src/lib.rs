//! The lifecycle engine: scale requests, agents, warm pools, backoff, reload; backends behind a trait.
