//! Per-agent egress policy in kici-scaler's own nftables table.
