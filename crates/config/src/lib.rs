//! Loads scalers.yaml and scalers.d/ into a validated Config snapshot, with file:line:col errors.
