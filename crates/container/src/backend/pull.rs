//! Making an agent's image present per `imagePullPolicy`, one pull per
//! image at a time, with registry credentials.

use super::*;

impl ContainerBackend {
    pub(super) fn pull_lock(&self, image: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.inner
            .pulls
            .lock()
            .entry(image.to_owned())
            .or_default()
            .clone()
    }

    /// Makes the image present per `policy`.
    pub(super) async fn ensure_image(
        &self,
        rt: &Runtime,
        image: &ImageReference,
        policy: ImagePullPolicy,
        api_deadline: Duration,
        pull_deadline: Instant,
    ) -> Result<(), StepError> {
        let docker = &rt.conn.docker;
        let present = || async {
            rt.call_opt(
                "GET /images/{name}/json",
                api_deadline,
                docker.inspect_image(image.as_str()),
            )
            .await
            .map(|found| found.is_some())
        };
        match policy {
            ImagePullPolicy::Never => {
                return if present().await? {
                    Ok(())
                } else {
                    Err(StepError::ImageAbsent {
                        image: image.to_string(),
                    })
                };
            }
            ImagePullPolicy::IfNotPresent => {
                if present().await? {
                    return Ok(());
                }
            }
            // A digest names immutable content: present is up to date.
            ImagePullPolicy::Always if image.is_digest_pinned() => {
                if present().await? {
                    return Ok(());
                }
            }
            ImagePullPolicy::Always => {}
        }
        let lock = self.pull_lock(image.as_str());
        let _one_pull = lock.lock().await;
        let config = self
            .inner
            .options
            .registry_config
            .clone()
            .or_else(auth::default_config_path);
        let credentials = match &config {
            Some(path) => auth::credentials_for(path, image.registry()).await?,
            None => None,
        };
        let options = CreateImageOptions {
            from_image: Some(image.repository()),
            tag: Some(image.pull_tag().to_owned()),
            ..Default::default()
        };
        let pull_error = |reason: String| StepError::Pull {
            image: image.to_string(),
            reason,
        };
        tracing::info!(image = %image, authenticated = credentials.is_some(), "pulling image");
        let mut stream = docker.create_image(Some(options), None, credentials);
        loop {
            match tokio::time::timeout_at(pull_deadline, stream.next()).await {
                Err(_) => {
                    return Err(pull_error(
                        "not finished within provisionTimeout".to_owned(),
                    ))
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err(pull_error(e.to_string())),
                Ok(Some(Ok(info))) => {
                    if let Some(detail) = info.error_detail.and_then(|d| d.message) {
                        return Err(pull_error(detail));
                    }
                }
            }
        }
        Ok(())
    }
}
