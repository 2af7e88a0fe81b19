//! The Postgres store: the same documents and change log in two tables
//! (`migrations/`). Batches run in one transaction with the touched rows locked, so a
//! precondition failure rolls everything back and concurrent writers serialise per key.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio_postgres::{Client, NoTls};

use crate::store::{BoxFut, CHANGES_KEPT, Change, Doc, Expect, Kind, Op, Store, StoreError};

const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../migrations/0001_documents.sql")),
    (
        2,
        include_str!("../migrations/0002_assignment_feed_and_versions.sql"),
    ),
];

/// The longest a store operation may take, the wait for the connection included: past
/// it the operation fails `Unavailable` and the connection is opened again for the
/// next (a connection that hung, its server gone without a reset, held every request
/// of the control plane behind its one lock for as long as TCP took to notice).
const OP_TIMEOUT: Duration = Duration::from_secs(20);

/// Set on every session: a batch waiting on another instance's transaction gives up
/// (rather than holding this instance's only connection), and a transaction its client
/// left open (an instance cut off mid-batch) is ended by the server, releasing the
/// lock every writer takes.
const SESSION_LIMITS: &str = "SET lock_timeout = '5s'; \
     SET statement_timeout = '15s'; \
     SET idle_in_transaction_session_timeout = '15s'";

/// A Postgres-backed store.
pub struct PgStore {
    conn: tokio::sync::Mutex<Conn>,
    /// Where to connect again: the URL tokio-postgres parses, and its TLS.
    url: String,
    tls: crate::pg_tls::PgTls,
    feed: Feed,
    /// Operations run on the connection (each takes it once), for tests and metrics.
    operations: AtomicU64,
}

/// Old changes one write cuts at most (see `batch`).
pub const TRIM_BATCH: usize = 10_000;

/// How often a waiting feed read looks for another instance's writes.
const FEED_POLL: Duration = Duration::from_millis(50);

/// What waiting feed reads ([`Store::changes`] with a wait) share: the change log's
/// head as this instance last saw it (raised by its own commits, set by a poll), and
/// whether one of them is polling the head for all. Each waiter polled on its own
/// before: two queries every 50 ms per waiting broker, on the store's one connection,
/// so a few hundred brokers' long polls held the heartbeats (their leases) behind them.
/// Now one query every 50 ms whatever the number waiting, plus a page read by each
/// waiter when the head moves. A waiter reads again on any change of the value after
/// its page read, not on a value above it: a head that went back (a restored database)
/// would have ended every wait at once, each waiter reading in a loop.
#[derive(Debug)]
struct Feed {
    head: tokio::sync::watch::Sender<u64>,
    polling: AtomicBool,
    /// Up to where the log was cut, as the last page read found its oldest change.
    trimmed: AtomicU64,
}

impl Feed {
    /// This instance committed changes up to `seq`: waiters wake.
    fn committed(&self, seq: u64) {
        self.head.send_if_modified(|h| {
            let moved = seq > *h;
            *h = (*h).max(seq);
            moved
        });
    }

    /// A poll read the head: waiters wake if it is not what was seen before.
    fn polled(&self, head: u64) {
        self.head
            .send_if_modified(|h| std::mem::replace(h, head) != head);
    }
}

/// The polling turn of one waiter, given back when it ends (or its read is dropped).
struct PollTurn<'a>(&'a AtomicBool);

impl<'a> PollTurn<'a> {
    fn take(polling: &'a AtomicBool) -> Option<Self> {
        // Lazily: a turn made and dropped for nothing would give back another's.
        (!polling.swap(true, Ordering::AcqRel)).then(|| PollTurn(polling))
    }
}

impl Drop for PollTurn<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The store's one connection.
struct Conn {
    client: Client,
    /// An operation on it was left part way (timed out): its state is unknown, and it
    /// is replaced before the next.
    broken: bool,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgStore")
    }
}

fn unavailable(e: tokio_postgres::Error) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

/// Opens a connection to `url` with `tls`, its session limits set.
async fn open(url: &str, tls: &crate::pg_tls::PgTls) -> anyhow::Result<Client> {
    let failed = |e: tokio_postgres::Error| {
        // The cause (a certificate that does not verify, say) sits in the sources.
        let mut message = format!("connecting to postgres: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            message.push_str(&format!(": {s}"));
            source = s.source();
        }
        anyhow::anyhow!(message)
    };
    let mut config: tokio_postgres::Config = url.parse().map_err(failed)?;
    // A server gone silent is noticed in seconds, not after the kernel's two hours.
    config
        .connect_timeout(Duration::from_secs(5))
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3);
    let client = match tls {
        crate::pg_tls::PgTls::Off => {
            let (client, conn) = config.connect(NoTls).await.map_err(failed)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::error!(error = %e, "postgres connection ended");
                }
            });
            client
        }
        crate::pg_tls::PgTls::VerifyFull { ca } => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
            let tls = crate::pg_tls::MakeRustls::from_ca_file(ca)?;
            let (client, conn) = config.connect(tls).await.map_err(failed)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::error!(error = %e, "postgres connection ended");
                }
            });
            client
        }
    };
    client.batch_execute(SESSION_LIMITS).await?;
    Ok(client)
}

impl PgStore {
    /// Connects (over TLS with `sslmode=verify-full`, see [`crate::pg_tls`]) and applies
    /// the migrations that have not run yet.
    pub async fn connect(url: &str) -> anyhow::Result<PgStore> {
        let (url, tls) =
            crate::pg_tls::split(url).map_err(|e| anyhow::anyhow!("store URL: {e}"))?;
        let mut client = open(&url, &tls).await?;
        client
            .batch_execute("CREATE TABLE IF NOT EXISTS felix_migrations (id INT PRIMARY KEY)")
            .await?;
        for (id, sql) in MIGRATIONS {
            // One instance at a time, each migration with its mark in one transaction:
            // instances starting together ran a migration twice.
            let tx = client.transaction().await?;
            tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
                .await?;
            tx.execute("SELECT pg_advisory_xact_lock(7464)", &[])
                .await?;
            let done = tx
                .query_opt("SELECT id FROM felix_migrations WHERE id = $1", &[id])
                .await?
                .is_some();
            if !done {
                tx.batch_execute(sql).await?;
                tx.execute("INSERT INTO felix_migrations (id) VALUES ($1)", &[id])
                    .await?;
            }
            tx.commit().await?;
        }
        Ok(PgStore {
            conn: tokio::sync::Mutex::new(Conn {
                client,
                broken: false,
            }),
            url,
            tls,
            feed: Feed {
                head: tokio::sync::watch::Sender::new(0),
                polling: AtomicBool::new(false),
                trimmed: AtomicU64::new(0),
            },
            operations: AtomicU64::new(0),
        })
    }

    /// Operations run on the connection so far.
    pub fn operations(&self) -> u64 {
        self.operations.load(Ordering::Relaxed)
    }

    /// The change log's head: the highest sequence committed.
    async fn read_head(&self) -> Result<u64, StoreError> {
        self.bounded(async {
            let mut c = self.client().await?;
            let head = c
                .query_one("SELECT COALESCE(MAX(seq), 0) FROM felix_changes", &[])
                .await
                .map_err(unavailable)
                .map(|r| r.get::<_, i64>(0) as u64);
            c.finish(head)
        })
        .await
    }

    /// Waits until `news` (subscribed before the caller's page read) changes, or
    /// `deadline`: one waiter at a time polls the log's head for every waiter
    /// ([`Feed`]), and wakes at once for this instance's own commits; the others wait
    /// for what it sees (or, should it stop, take its turn within two polls).
    async fn wait_for_news(
        &self,
        news: &mut tokio::sync::watch::Receiver<u64>,
        deadline: tokio::time::Instant,
    ) -> Result<(), StoreError> {
        loop {
            if news.has_changed().unwrap_or(true) {
                return Ok(());
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(());
            }
            match PollTurn::take(&self.feed.polling) {
                Some(_turn) => {
                    let poll_at = (now + FEED_POLL).min(deadline);
                    tokio::select! {
                        () = tokio::time::sleep_until(poll_at) => {}
                        _ = news.changed() => return Ok(()),
                    }
                    if poll_at >= deadline {
                        // The caller reads its last page now: no poll needed first.
                        return Ok(());
                    }
                    let head = self.read_head().await?;
                    self.feed.polled(head);
                }
                None => {
                    // (`changed` marks what it returns as seen: news, not a look again.)
                    if tokio::time::timeout_at((now + FEED_POLL * 2).min(deadline), news.changed())
                        .await
                        .is_ok()
                    {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// The connection, opened again first if it was lost (a Postgres restart or
    /// failover, a reset: the store failed every operation for good after one) or an
    /// operation on it was left part way.
    async fn client(&self) -> Result<ConnGuard<'_>, StoreError> {
        let mut conn = self.conn.lock().await;
        self.operations.fetch_add(1, Ordering::Relaxed);
        if conn.broken || conn.client.is_closed() {
            let client = open(&self.url, &self.tls)
                .await
                .map_err(|e| StoreError::Unavailable(format!("{e:#}")))?;
            *conn = Conn {
                client,
                broken: false,
            };
        }
        Ok(ConnGuard {
            conn,
            finished: false,
        })
    }

    /// Runs one store operation for at most [`OP_TIMEOUT`], its wait for the connection
    /// included. One cut short on the connection leaves it to be replaced
    /// ([`ConnGuard`]); one cut short waiting for it leaves it be.
    async fn bounded<T>(
        &self,
        op: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(OP_TIMEOUT, op)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Unavailable(format!(
                    "the store did not answer in {OP_TIMEOUT:?}"
                )))
            })
    }
}

/// The connection lent to one operation. Dropped before the operation ends (cut short
/// by [`OP_TIMEOUT`] mid-exchange), it marks the connection broken, to be opened again
/// before the next.
struct ConnGuard<'a> {
    conn: tokio::sync::MutexGuard<'a, Conn>,
    finished: bool,
}

impl ConnGuard<'_> {
    /// The operation ended with `r`, its exchange with the server complete whatever
    /// `r` is (a server-side error leaves the connection usable; a lost one is seen
    /// closed at the next operation).
    fn finish<T>(&mut self, r: Result<T, StoreError>) -> Result<T, StoreError> {
        self.finished = true;
        r
    }
}

impl std::ops::Deref for ConnGuard<'_> {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.conn.client
    }
}

impl std::ops::DerefMut for ConnGuard<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.conn.client
    }
}

impl Drop for ConnGuard<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.conn.broken = true;
        }
    }
}

fn check(kind: Kind, key: &str, found: Option<i64>, expect: Expect) -> Result<(), StoreError> {
    let found = found.map(|v| v as u64);
    let conflict = |reason: String| StoreError::Conflict {
        kind: kind.name(),
        key: key.to_owned(),
        reason,
    };
    match (expect, found) {
        (Expect::Any, _) | (Expect::Absent, None) | (Expect::Present, Some(_)) => Ok(()),
        (Expect::Absent, Some(_)) => Err(conflict("already exists".into())),
        (Expect::Present | Expect::Version(_), None) => Err(StoreError::NotFound {
            kind: kind.name(),
            key: key.to_owned(),
        }),
        (Expect::Version(v), Some(f)) if v == f => Ok(()),
        (Expect::Version(v), Some(f)) => Err(conflict(format!("version is {f}, expected {v}"))),
    }
}

impl Store for PgStore {
    fn get<'a>(&'a self, kind: Kind, key: &'a str) -> BoxFut<'a, Option<Doc>> {
        Box::pin(self.bounded(async move {
            let mut c = self.client().await?;
            let row = c
                .query_opt(
                    "SELECT version, value FROM felix_docs WHERE kind = $1 AND key = $2",
                    &[&kind.name(), &key],
                )
                .await
                .map_err(unavailable);
            c.finish(row).map(|row| {
                row.map(|r| Doc {
                    key: key.to_owned(),
                    version: r.get::<_, i64>(0) as u64,
                    value: r.get::<_, Value>(1),
                })
            })
        }))
    }

    fn list<'a>(&'a self, kind: Kind, prefix: &'a str) -> BoxFut<'a, Vec<Doc>> {
        Box::pin(self.bounded(async move {
            let mut c = self.client().await?;
            let pattern = format!(
                "{}%",
                prefix
                    .replace('\\', "\\\\")
                    .replace('%', "\\%")
                    .replace('_', "\\_")
            );
            let rows = c
                .query(
                    "SELECT key, version, value FROM felix_docs WHERE kind = $1 AND key LIKE $2 ORDER BY key COLLATE \"C\"",
                    &[&kind.name(), &pattern],
                )
                .await
                .map_err(unavailable);
            c.finish(rows).map(|rows| {
                rows.into_iter()
                    .map(|r| Doc {
                        key: r.get(0),
                        version: r.get::<_, i64>(1) as u64,
                        value: r.get(2),
                    })
                    .collect()
            })
        }))
    }

    fn batch(&self, ops: Vec<Op>) -> BoxFut<'_, Vec<Doc>> {
        Box::pin(self.bounded(async move {
            let mut c = self.client().await?;
            let written = async {
            let tx = c.transaction().await.map_err(unavailable)?;
            // One writer at a time across every control-plane instance: change
            // sequence numbers then become visible in order, so a feed reader that has
            // seen seq N never later finds a smaller one committed behind it.
            tx.execute("SELECT pg_advisory_xact_lock(7463)", &[])
                .await
                .map_err(unavailable)?;
            let (mut written, mut logged) = (Vec::new(), 0u64);
            for op in ops {
                let (kind, key, expect) = match &op {
                    Op::Put {
                        kind, key, expect, ..
                    }
                    | Op::Delete { kind, key, expect } => (*kind, key.clone(), *expect),
                };
                let found: Option<i64> = tx
                    .query_opt(
                        "SELECT version FROM felix_docs WHERE kind = $1 AND key = $2 FOR UPDATE",
                        &[&kind.name(), &key],
                    )
                    .await
                    .map_err(unavailable)?
                    .map(|r| r.get(0));
                // Returning drops the transaction: rolled back.
                check(kind, &key, found, expect)?;
                match op {
                    Op::Put { value, .. } => {
                        // Versions come from one sequence: never repeated for a key, a
                        // delete and a create again included (a write conditional on a
                        // version read before the delete landed on the new document).
                        let r = tx
                            .query_one(
                                "INSERT INTO felix_docs (kind, key, version, value) \
                                 VALUES ($1, $2, nextval('felix_doc_versions'), $3) \
                                 ON CONFLICT (kind, key) DO UPDATE SET version = EXCLUDED.version, value = EXCLUDED.value \
                                 RETURNING version",
                                &[&kind.name(), &key, &value],
                            )
                            .await;
                        let version: i64 = match r {
                            Ok(row) => row.get(0),
                            Err(e) => {
                            // A concurrent create of the same key lost the race.
                            return Err(match e.code() {
                                Some(c)
                                    if *c == tokio_postgres::error::SqlState::UNIQUE_VIOLATION =>
                                {
                                    StoreError::Conflict {
                                        kind: kind.name(),
                                        key,
                                        reason: "already exists".into(),
                                    }
                                }
                                _ => unavailable(e),
                            });
                            }
                        };
                        if kind.followed() {
                            let seq: i64 = tx
                                .query_one(
                                    "INSERT INTO felix_changes (kind, key, op, value) VALUES ($1, $2, 'put', $3) RETURNING seq",
                                    &[&kind.name(), &key, &value],
                                )
                                .await
                                .map_err(unavailable)?
                                .get(0);
                            logged = logged.max(seq as u64);
                        }
                        written.push(Doc {
                            key,
                            version: version as u64,
                            value,
                        });
                    }
                    Op::Delete { .. } => {
                        tx.execute(
                            "DELETE FROM felix_docs WHERE kind = $1 AND key = $2",
                            &[&kind.name(), &key],
                        )
                        .await
                        .map_err(unavailable)?;
                        if kind.followed() {
                            let seq: i64 = tx
                                .query_one(
                                    "INSERT INTO felix_changes (kind, key, op, value) VALUES ($1, $2, 'delete', NULL) RETURNING seq",
                                    &[&kind.name(), &key],
                                )
                                .await
                                .map_err(unavailable)?
                                .get(0);
                            logged = logged.max(seq as u64);
                        }
                    }
                }
            }
            if logged > CHANGES_KEPT as u64 {
                // The log keeps its newest changes (at most `CHANGES_KEPT`: sequence
                // numbers of rolled-back writes are never used), cut a bounded number
                // at a time: the backlog a log kept for good before is cut over the
                // next writes, not in one that outlives its deadline.
                tx.execute(
                    "DELETE FROM felix_changes WHERE seq IN \
                     (SELECT seq FROM felix_changes WHERE seq <= $1 ORDER BY seq LIMIT $2)",
                    &[
                        &((logged - CHANGES_KEPT as u64) as i64),
                        &(TRIM_BATCH as i64),
                    ],
                )
                .await
                .map_err(unavailable)?;
            }
            tx.commit().await.map_err(unavailable)?;
            // This instance's own writes wake its waiting feed reads at once.
            self.feed.committed(logged);
            Ok(written)
            }
            .await;
            // A refused precondition ends the operation as cleanly as a commit does.
            c.finish(written)
        }))
    }

    fn changes(
        &self,
        kind: Kind,
        since: u64,
        limit: usize,
        wait: Duration,
    ) -> BoxFut<'_, (Vec<Change>, u64)> {
        Box::pin(async move {
            let deadline = tokio::time::Instant::now() + wait;
            let mut news = self.feed.head.subscribe();
            loop {
                // What is seen from here on is news to this read.
                news.borrow_and_update();
                let (page, head, oldest) = self.bounded(async {
                    let mut c = self.client().await?;
                    let read = async {
                    // The head first, then the page up to it: writers commit one at a
                    // time (the advisory lock), in sequence order, so every change up
                    // to the head is visible to the page's later read. Read the other
                    // way round, a change committed between the two was past the page
                    // and below the head answered as the next place to ask from: the
                    // follower never saw it.
                    let head: i64 = c
                        .query_one("SELECT COALESCE(MAX(seq), 0) FROM felix_changes", &[])
                        .await
                        .map_err(unavailable)?
                        .get(0);
                    let rows = c
                        .query(
                            "SELECT seq, key, op, value FROM felix_changes WHERE kind = $1 AND seq > $2 AND seq <= $4 ORDER BY seq LIMIT $3",
                            &[&kind.name(), &(since as i64), &(limit as i64), &head],
                        )
                        .await
                        .map_err(unavailable)?;
                    let page: Vec<Change> = rows
                        .into_iter()
                        .map(|r| Change {
                            seq: r.get::<_, i64>(0) as u64,
                            key: r.get(1),
                            op: r.get(2),
                            value: r.get(3),
                        })
                        .collect();
                    // After the page: a cut the page may have missed changes to is
                    // below the oldest change left now (see `trimmed`).
                    let oldest: i64 = c
                        .query_one("SELECT COALESCE(MIN(seq), 0) FROM felix_changes", &[])
                        .await
                        .map_err(unavailable)?
                        .get(0);
                    Ok((page, head as u64, oldest as u64))
                    }
                    .await;
                    c.finish(read)
                })
                .await?;
                self.feed
                    .trimmed
                    .fetch_max(oldest.saturating_sub(1), Ordering::Relaxed);
                if !page.is_empty() {
                    let next = page.last().map_or(head, |c| c.seq);
                    return Ok((page, next));
                }
                if tokio::time::Instant::now() >= deadline {
                    return Ok((Vec::new(), head.max(since)));
                }
                self.wait_for_news(&mut news, deadline).await?;
            }
        })
    }

    /// From this instance's page reads: below the oldest change the latest found (a
    /// sequence a rolled-back write took may count as cut too, asking for a resync not
    /// needed), never decreasing, so concurrent reads cannot lower it under one
    /// another; after a restore of an older database it stays high until a restart,
    /// asking readers below it for resyncs they do not need. Read after a `changes`, it
    /// covers every cut that page missed, at no query of its own.
    fn trimmed(&self) -> BoxFut<'_, u64> {
        let trimmed = self.feed.trimmed.load(Ordering::Relaxed);
        Box::pin(async move { Ok(trimmed) })
    }

    fn head(&self) -> BoxFut<'_, u64> {
        Box::pin(self.read_head())
    }

    fn ping(&self) -> BoxFut<'_, ()> {
        Box::pin(self.bounded(async move {
            let mut c = self.client().await?;
            let answered = c.simple_query("SELECT 1").await.map_err(unavailable);
            c.finish(answered).map(|_| ())
        }))
    }
}
