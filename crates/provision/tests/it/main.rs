//! kici-provision's integration tests, one binary: real provisioner
//! processes, a loopback webhook receiver, and the command environment.

mod command_env;
mod delivery;
