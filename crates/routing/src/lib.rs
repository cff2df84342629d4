//! Routes a job's labels to a scaler label set and explains every candidate.
