//! A host's one PostgreSQL **session**: the connection that carries
//! everything that lives as long as a session — advisory locks (the
//! instance's identity lock, a fleet's leadership) and `LISTEN` — so that a
//! host holds a fixed, small number of connections however many of those
//! it needs.
//!
//! The session is taken from the host's pool (it counts against the pool's
//! size) and owned by one task. Callers talk to it through [`PgSession`]:
//! lock and unlock commands run on the session's connection between
//! notifications; notifications and resets are broadcast as [`Notice`]s.
//!
//! # Resets
//!
//! When the connection is lost (a server restart, a terminated backend, a
//! partition that made the server end it), every advisory lock and every
//! `LISTEN` went with it. The task then bumps the session's
//! [`generation`](PgSession::generation), broadcasts [`Notice::Reset`], and
//! takes a new connection from the pool (re-issuing the `LISTEN`s). A lock
//! holder compares the generation its lock was taken under
//! ([`Locked::generation`]) with the current one: different means the lock
//! is gone and must be taken again, and somebody else may hold it now.
//!
//! # Partitions
//!
//! With [`SessionOptions::idle_timeout`] the server ends the session after
//! that long without a query (`idle_session_timeout`, PostgreSQL 14+), and
//! the task queries every [`SessionOptions::keepalive`] — so a host cut off
//! from the database loses its locks on the server's side within the idle
//! timeout, and leadership can move, instead of when TCP gives up minutes
//! later.

use crate::error::{classify, StoreError};
use sqlx::postgres::{PgListener, PgPool};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{broadcast, mpsc, oneshot};

/// The key of a session-level advisory lock, in either of PostgreSQL's two
/// key spaces (they do not overlap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AdvisoryKey {
    /// `pg_advisory_lock(bigint)`.
    Single(i64),
    /// `pg_advisory_lock(int, int)`.
    Pair(i32, i32),
}

/// A lock this session took, and under which generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Locked {
    /// The session's generation when the lock was taken: while
    /// [`PgSession::generation`] still equals it, the lock is held.
    pub generation: u64,
}

/// What the session tells its subscribers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// A `NOTIFY` on one of the session's channels.
    Notification {
        /// The channel.
        channel: String,
        /// The payload.
        payload: String,
    },
    /// The connection was lost: notifications may have been missed and
    /// every lock of the previous generation is gone.
    Reset,
}

/// How the session behaves.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Channels to `LISTEN` on (again after every reset).
    pub channels: Vec<String>,
    /// How often the task sends a query when nothing else did (keeps
    /// [`SessionOptions::idle_timeout`] from ending a healthy session).
    pub keepalive: Duration,
    /// The server ends the session after this long without a query
    /// (`idle_session_timeout`); `None` leaves the server's setting.
    pub idle_timeout: Option<Duration>,
    /// Bound on one command (connecting included).
    pub call_timeout: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            channels: Vec::new(),
            keepalive: Duration::from_secs(1),
            idle_timeout: None,
            call_timeout: Duration::from_secs(3),
        }
    }
}

/// One statement on the session's connection (see [`Task::run_query`]).
type QueryFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, sqlx::Error>> + Send + 'a>>;

enum Command {
    Lock(
        AdvisoryKey,
        oneshot::Sender<Result<Option<Locked>, StoreError>>,
    ),
    Unlock(AdvisoryKey, oneshot::Sender<Result<(), StoreError>>),
    Pid(oneshot::Sender<Option<i32>>),
    Listen(String, oneshot::Sender<Result<(), StoreError>>),
    Ping(oneshot::Sender<Result<(), StoreError>>),
}

/// The handle on a host's session (cheap to clone). The session ends when
/// [`PgSession::close`] is called or the pool is closed.
#[derive(Clone)]
pub struct PgSession {
    commands: mpsc::Sender<Command>,
    notices: broadcast::Sender<Notice>,
    generation: Arc<AtomicU64>,
    call_timeout: Duration,
    task: Arc<tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>>,
}

impl std::fmt::Debug for PgSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgSession")
            .field("generation", &self.generation())
            .finish()
    }
}

/// Notices kept for a slow subscriber before it sees `Lagged` (which it
/// must treat like a reset: it missed something).
const NOTICE_BUFFER: usize = 1024;
/// The longest the task waits before trying a lost connection again.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

impl PgSession {
    /// Takes one connection from `pool` for the session, `LISTEN`s on the
    /// channels, and starts the task that owns it.
    pub async fn open(pool: &PgPool, options: SessionOptions) -> Result<Self, StoreError> {
        let listener = connect(pool, &options).await?;
        let (commands, rx) = mpsc::channel(64);
        let (notices, _) = broadcast::channel(NOTICE_BUFFER);
        let generation = Arc::new(AtomicU64::new(1));
        let call_timeout = options.call_timeout;
        let task = tokio::spawn(
            Task {
                pool: pool.clone(),
                listener: Some(listener),
                options,
                commands: rx,
                notices: notices.clone(),
                generation: Arc::clone(&generation),
            }
            .run(),
        );
        Ok(Self {
            commands,
            notices,
            generation,
            call_timeout,
            task: Arc::new(tokio::sync::Mutex::new(Some(task))),
        })
    }

    /// The current generation: it grows by one at every reset.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether a lock taken as `locked` is still held.
    pub fn holds(&self, locked: Locked) -> bool {
        locked.generation == self.generation()
    }

    /// Notifications and resets from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }

    /// `pg_try_advisory_lock` on the session: `Some` if this session holds
    /// the lock now (taking a lock it already holds succeeds again), `None`
    /// if another session holds it.
    pub async fn try_lock(&self, key: AdvisoryKey) -> Result<Option<Locked>, StoreError> {
        self.call(|tx| Command::Lock(key, tx)).await?
    }

    /// Releases one hold of `key` (a lock of an earlier generation is
    /// already gone; that is not an error).
    pub async fn unlock(&self, key: AdvisoryKey) -> Result<(), StoreError> {
        self.call(|tx| Command::Unlock(key, tx)).await?
    }

    /// `LISTEN`s on `channel` from now on (again after every reset);
    /// notifications on it reach [`PgSession::subscribe`]rs.
    pub async fn listen(&self, channel: &str) -> Result<(), StoreError> {
        self.call(|tx| Command::Listen(channel.to_owned(), tx))
            .await?
    }

    /// One round trip on the session: `Ok` if it answered. A session that
    /// does not is reset (so [`PgSession::holds`] tells the truth after
    /// this returns, not only once the task noticed on its own).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.call(Command::Ping).await?
    }

    /// The backend process id of the session's connection, for operators
    /// (`pg_stat_activity`) and tests; `None` while it is not connected.
    pub async fn backend_pid(&self) -> Option<i32> {
        self.call(Command::Pid).await.ok().flatten()
    }

    /// Ends the session (its locks are released by the server) and returns
    /// its connection to the pool. Idempotent.
    pub async fn close(&self) {
        if let Some(task) = self.task.lock().await.take() {
            task.abort();
            // The listener is dropped with the task; a broken one is
            // discarded by the pool.
            let _ = task.await;
        }
    }

    async fn call<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        let gone = || StoreError::Unavailable("the database session has ended".into());
        self.commands.send(command(tx)).await.map_err(|_| gone())?;
        tokio::time::timeout(self.call_timeout, rx)
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "the database session did not answer within {:?}",
                    self.call_timeout
                ))
            })?
            .map_err(|_| gone())
    }
}

/// A new session connection from `pool`, set up: idle timeout, channels.
async fn connect(pool: &PgPool, options: &SessionOptions) -> Result<PgListener, StoreError> {
    let setup = async {
        let mut listener = PgListener::connect_with(pool).await?;
        // Reconnecting is the task's job, so that a reset is always seen
        // (and counted) before anything runs on a new connection.
        listener.eager_reconnect(false);
        if let Some(idle) = options.idle_timeout {
            let ms = idle.as_millis().max(1);
            // PostgreSQL 14 and later; an older server keeps TCP's timing.
            if let Err(e) = sqlx::query(&format!("SET idle_session_timeout = {ms}"))
                .execute(&mut listener)
                .await
            {
                if is_connection_error(&e) {
                    return Err(e);
                }
                tracing::debug!(error = %e, "idle_session_timeout not available");
            }
        }
        for channel in &options.channels {
            listener.listen(channel).await?;
        }
        Ok(listener)
    };
    tokio::time::timeout(options.call_timeout, setup)
        .await
        .map_err(|_| {
            StoreError::Unavailable(format!(
                "connecting the database session took over {:?}",
                options.call_timeout
            ))
        })?
        .map_err(classify)
}

fn is_connection_error(e: &sqlx::Error) -> bool {
    matches!(
        e,
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed
    )
}

struct Task {
    pool: PgPool,
    /// `None` after a reset, until a new connection is set up.
    listener: Option<PgListener>,
    options: SessionOptions,
    commands: mpsc::Receiver<Command>,
    notices: broadcast::Sender<Notice>,
    generation: Arc<AtomicU64>,
}

impl Task {
    async fn run(mut self) {
        let mut backoff = Duration::from_millis(50);
        let mut keepalive = tokio::time::interval(self.options.keepalive);
        keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let Some(listener) = self.listener.as_mut() else {
                match connect(&self.pool, &self.options).await {
                    Ok(l) => {
                        self.listener = Some(l);
                        backoff = Duration::from_millis(50);
                    }
                    Err(e) => {
                        if self.pool.is_closed() {
                            return;
                        }
                        tracing::debug!(error = %e, "database session not connected; retrying");
                        // A command meanwhile tries the connection at once (the
                        // server may be back before the backoff ends) and is
                        // refused only if that fails too.
                        let until = tokio::time::Instant::now() + backoff;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                        loop {
                            match tokio::time::timeout_at(until, self.commands.recv()).await {
                                Ok(Some(c)) => match connect(&self.pool, &self.options).await {
                                    Ok(l) => {
                                        self.listener = Some(l);
                                        backoff = Duration::from_millis(50);
                                        self.execute(c).await;
                                        break;
                                    }
                                    Err(again) => refuse(c, &again),
                                },
                                Ok(None) => return,
                                Err(_) => break,
                            }
                        }
                    }
                }
                continue;
            };
            tokio::select! {
                biased;
                command = self.commands.recv() => match command {
                    Some(c) => self.execute(c).await,
                    None => return,
                },
                _ = keepalive.tick() => {
                    let alive = tokio::time::timeout(
                        self.options.call_timeout,
                        sqlx::query("SELECT 1").execute(&mut *listener),
                    )
                    .await;
                    if !matches!(alive, Ok(Ok(_))) {
                        self.reset();
                    }
                }
                received = listener.try_recv() => match received {
                    Ok(Some(n)) => {
                        let _ = self.notices.send(Notice::Notification {
                            channel: n.channel().to_owned(),
                            payload: n.payload().to_owned(),
                        });
                    }
                    Ok(None) => self.reset(),
                    Err(sqlx::Error::PoolClosed) => return,
                    Err(e) => {
                        tracing::debug!(error = %e, "database session failed");
                        self.reset();
                    }
                },
            }
        }
    }

    /// The connection is gone (or must be given up: a query on it timed
    /// out, so its state is unknown): locks and missed notifications are
    /// announced lost before anything runs on a new one.
    fn reset(&mut self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.listener = None;
        let _ = self.notices.send(Notice::Reset);
        tracing::warn!("the database session was lost; its locks are gone, reconnecting");
    }

    /// Runs one statement on the session's connection, bounded. Any error
    /// or a timeout resets the session: its statements (a lock, `SELECT 1`,
    /// `LISTEN`) fail only when the connection is gone or unusable — a
    /// terminated backend answers with an error before the socket closes —
    /// and a reset is cheap next to acting on a session that is not there.
    async fn run_query<T, F>(&mut self, f: F) -> Result<T, StoreError>
    where
        F: for<'a> FnOnce(&'a mut PgListener) -> QueryFuture<'a, T>,
    {
        let Some(listener) = self.listener.as_mut() else {
            return Err(StoreError::Unavailable(
                "the database session is reconnecting".into(),
            ));
        };
        match tokio::time::timeout(self.options.call_timeout, f(listener)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.reset();
                Err(classify(e))
            }
            Err(_) => {
                self.reset();
                Err(StoreError::Unavailable(format!(
                    "the database session did not answer within {:?}",
                    self.options.call_timeout
                )))
            }
        }
    }

    async fn execute(&mut self, command: Command) {
        let generation = self.generation.load(Ordering::Acquire);
        match command {
            Command::Lock(key, reply) => {
                let r = self
                    .run_query(|l| {
                        Box::pin(async move {
                            match key {
                                AdvisoryKey::Single(k) => {
                                    sqlx::query_scalar::<_, bool>("SELECT pg_try_advisory_lock($1)")
                                        .bind(k)
                                        .fetch_one(l)
                                        .await
                                }
                                AdvisoryKey::Pair(a, b) => {
                                    sqlx::query_scalar::<_, bool>(
                                        "SELECT pg_try_advisory_lock($1, $2)",
                                    )
                                    .bind(a)
                                    .bind(b)
                                    .fetch_one(l)
                                    .await
                                }
                            }
                        })
                    })
                    .await;
                let _ = reply.send(r.map(|got| got.then_some(Locked { generation })));
            }
            Command::Unlock(key, reply) => {
                let r = self
                    .run_query(|l| {
                        Box::pin(async move {
                            match key {
                                AdvisoryKey::Single(k) => {
                                    sqlx::query("SELECT pg_advisory_unlock($1)")
                                        .bind(k)
                                        .execute(l)
                                        .await
                                }
                                AdvisoryKey::Pair(a, b) => {
                                    sqlx::query("SELECT pg_advisory_unlock($1, $2)")
                                        .bind(a)
                                        .bind(b)
                                        .execute(l)
                                        .await
                                }
                            }
                        })
                    })
                    .await;
                let _ = reply.send(r.map(|_| ()));
            }
            Command::Listen(channel, reply) => {
                if !self.options.channels.contains(&channel) {
                    // Kept first: a reset before the LISTEN below ran still
                    // listens on the new connection.
                    self.options.channels.push(channel.clone());
                }
                let r = self
                    .run_query(|l| Box::pin(async move { l.listen(&channel).await }))
                    .await;
                let _ = reply.send(r);
            }
            Command::Ping(reply) => {
                let r = self
                    .run_query(|l| {
                        Box::pin(
                            async move { sqlx::query("SELECT 1").execute(l).await.map(|_| ()) },
                        )
                    })
                    .await;
                let _ = reply.send(r);
            }
            Command::Pid(reply) => {
                let pid = self
                    .run_query(|l| {
                        Box::pin(async move {
                            sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                                .fetch_one(l)
                                .await
                        })
                    })
                    .await
                    .ok();
                let _ = reply.send(pid);
            }
        }
    }
}

fn refuse(command: Command, why: &StoreError) {
    let e = || StoreError::Unavailable(format!("the database session is reconnecting: {why}"));
    match command {
        Command::Lock(_, reply) => {
            let _ = reply.send(Err(e()));
        }
        Command::Unlock(_, reply) => {
            let _ = reply.send(Err(e()));
        }
        Command::Pid(reply) => {
            let _ = reply.send(None);
        }
        Command::Listen(_, reply) => {
            let _ = reply.send(Err(e()));
        }
        Command::Ping(reply) => {
            let _ = reply.send(Err(e()));
        }
    }
}
