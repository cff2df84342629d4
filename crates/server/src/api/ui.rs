//! The operator's web console at `/ui/`: one page and its script and style,
//! embedded in the binary and served as they are.
//!
//! The page holds no data, so it is served without the bearer token (a
//! browser cannot attach one to a navigation); every call it then makes to
//! `/v1/*` and `/metrics` carries the token the operator typed or passed in
//! the link's `#token=…` fragment, and is checked like any other client's.
//! Nothing else is reachable without the token: these routes sit outside
//! the API's guard and answer only the few paths below.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// The page.
pub const INDEX_HTML: &str = include_str!("ui/index.html");
/// The script: the API client, the live state and every view.
pub const APP_JS: &str = include_str!("ui/app.js");
/// The style.
pub const APP_CSS: &str = include_str!("ui/app.css");

/// Where the console is.
pub const PATH: &str = "/ui/";

/// The page's own policy: its script and style only, calls to this origin
/// only, never framed (a framed confirmation could be clicked by a page
/// the operator did not mean to act on).
const CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'; \
                   connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; \
                   base-uri 'none'; form-action 'none'";

/// The console's routes, to merge outside the API's guard.
pub fn routes() -> Router {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent(PATH) }))
        .route(
            PATH,
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = (StatusCode::OK, body).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // A new binary brings a new page: never serve a stale one from cache.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The console must stay small: it is in every binary.
    #[test]
    fn assets_stay_small() {
        let total = INDEX_HTML.len() + APP_JS.len() + APP_CSS.len();
        assert!(total < 200 * 1024, "the console's assets are {total} bytes");
    }
}
