//! The container backend: agents as Docker/Podman containers.
