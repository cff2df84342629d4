//! Configuration reload (SIGHUP and `POST /v1/reload`): re-read the files,
//! validate them (agent binaries resolved as at start-up), let the runtime validate against every backend and apply
//! all or nothing. Each attempt is logged (one line per changed field) and
//! counted in `kici_orch_scaler_config_reloads_total{result}`.

use crate::events::metrics::Metrics;
use async_trait::async_trait;
use kici_engine::runtime::Runtime;
use kici_engine::ReloadReport;
use std::path::PathBuf;
use std::sync::Arc;

/// Something that can reload the daemon's configuration.
#[async_trait]
pub trait Reload: Send + Sync {
    /// Applies the configuration as it is now on disk. `Err` lists every
    /// problem; then nothing changed.
    async fn reload(&self) -> Result<ReloadReport, Vec<String>>;
}

/// Reloads from the files the daemon started with.
pub struct ConfigReloader {
    main: PathBuf,
    dir: Option<PathBuf>,
    runtime: Runtime,
    metrics: Arc<Metrics>,
    /// One reload at a time: two concurrent ones would validate against
    /// different "current" configurations.
    serial: tokio::sync::Mutex<()>,
}

impl ConfigReloader {
    pub fn new(
        main: PathBuf,
        dir: Option<PathBuf>,
        runtime: Runtime,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            main,
            dir,
            runtime,
            metrics,
            serial: tokio::sync::Mutex::new(()),
        }
    }
}

#[async_trait]
impl Reload for ConfigReloader {
    async fn reload(&self) -> Result<ReloadReport, Vec<String>> {
        let _serial = self.serial.lock().await;
        self.metrics.reload_attempted();
        let result = match crate::daemon::stack::load_config(&self.main, self.dir.as_deref()) {
            Err(errors) => Err(errors.lines()),
            Ok(loaded) => {
                for w in &loaded.warnings {
                    tracing::warn!(warning = %w, "configuration warning");
                }
                self.runtime.reload(Arc::new(loaded.config)).await
            }
        };
        match &result {
            Ok(report) => {
                self.metrics.reload_succeeded();
                for change in &report.changes {
                    tracing::info!(change = %change, "configuration field changed");
                }
                tracing::info!(
                    added = ?report.added,
                    removed = ?report.removed,
                    cancelled = ?report.cancelled,
                    changes = report.changes.len(),
                    "configuration reloaded"
                );
            }
            Err(errors) => {
                self.metrics.reload_failed();
                for e in errors {
                    tracing::error!(error = %e, "configuration reload refused");
                }
                tracing::error!(
                    errors = errors.len(),
                    "configuration reload refused; nothing changed"
                );
            }
        }
        result
    }
}
