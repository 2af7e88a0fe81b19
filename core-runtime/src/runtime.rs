//! The per-core executors and their lifecycle.
//!
//! [`Runtime::start`] starts one glommio executor per CPU in the [`CoreSet`], pinned to
//! it, and runs the given per-core body on each. [`Runtime::shutdown`] asks every core to
//! stop: each body watches [`CoreContext::shutdown`] and is expected to stop accepting,
//! drain, flush and return; [`Runtime::join`] waits for all of them.

use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Poll, Waker};

use crate::cores::{CoreId, CoreSet};
use crate::stats::CoreStats;

/// Executor settings.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// CPUs to pin to, one executor each.
    pub cores: CoreSet,
    /// io_uring registered buffer memory per core.
    pub io_memory_bytes: usize,
    /// Thread name prefix.
    pub name: String,
    /// Busy-poll this long before an idle executor sleeps (`None`: sleep at once).
    /// Trades CPU for latency: an executor that is still spinning when the next
    /// packet or completion arrives skips the wake-up (eventfd, context switch).
    pub spin_before_park: Option<std::time::Duration>,
}

impl RuntimeConfig {
    /// Defaults for `cores`.
    pub fn new(cores: CoreSet) -> Self {
        Self {
            cores,
            io_memory_bytes: 4 << 20,
            name: "felix-core".into(),
            spin_before_park: None,
        }
    }
}

#[derive(Debug, Default)]
struct ShutdownState {
    requested: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

/// Signals a runtime to stop.
#[derive(Debug, Clone, Default)]
pub struct ShutdownHandle(Arc<ShutdownState>);

impl ShutdownHandle {
    /// Asks every core to stop (idempotent).
    pub fn trigger(&self) {
        self.0.requested.store(true, Ordering::SeqCst);
        let wakers = std::mem::take(&mut *self.0.wakers.lock().expect("shutdown lock"));
        for w in wakers {
            w.wake();
        }
    }

    /// Whether stop was asked.
    pub fn is_triggered(&self) -> bool {
        self.0.requested.load(Ordering::SeqCst)
    }

    /// Resolves once stop is asked.
    pub async fn wait(&self) {
        std::future::poll_fn(|cx| {
            if self.is_triggered() {
                return Poll::Ready(());
            }
            self.0
                .wakers
                .lock()
                .expect("shutdown lock")
                .push(cx.waker().clone());
            if self.is_triggered() {
                return Poll::Ready(());
            }
            Poll::Pending
        })
        .await
    }
}

/// What each core's body is given.
#[derive(Debug, Clone)]
pub struct CoreContext {
    /// This core's index.
    pub core: CoreId,
    /// The CPU it is pinned to.
    pub cpu: usize,
    /// How many cores the runtime has.
    pub cores: usize,
    /// Stop signal.
    pub shutdown: ShutdownHandle,
    /// This core's statistics.
    pub stats: Arc<CoreStats>,
}

/// Running executors.
#[derive(Debug)]
pub struct Runtime {
    joins: Vec<glommio::ExecutorJoinHandle<()>>,
    shutdown: ShutdownHandle,
    stats: Vec<Arc<CoreStats>>,
}

/// Why the runtime could not start or finish.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// An executor failed to start (io_uring, memlock, affinity).
    #[error("starting the executor for core {core} (CPU {cpu}): {reason}")]
    Start {
        /// Core.
        core: usize,
        /// CPU.
        cpu: usize,
        /// Why.
        reason: String,
    },
    /// A core's body panicked.
    #[error("core {core} panicked: {reason}")]
    Panicked {
        /// Core.
        core: usize,
        /// Panic text.
        reason: String,
    },
}

impl Runtime {
    /// Starts one pinned executor per CPU and runs `body` on each.
    pub fn start<F, Fut>(config: RuntimeConfig, body: F) -> Result<Runtime, RuntimeError>
    where
        F: Fn(CoreContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let body = Arc::new(body);
        let shutdown = ShutdownHandle::default();
        let n = config.cores.len();
        let mut joins = Vec::with_capacity(n);
        let mut stats = Vec::with_capacity(n);
        for i in 0..n {
            let core = CoreId(i);
            let cpu = config.cores.cpu(core);
            let core_stats = Arc::new(CoreStats::default());
            stats.push(core_stats.clone());
            let ctx = CoreContext {
                core,
                cpu,
                cores: n,
                shutdown: shutdown.clone(),
                stats: core_stats,
            };
            let body = body.clone();
            let mut builder = glommio::LocalExecutorBuilder::new(glommio::Placement::Fixed(cpu))
                .name(&format!("{}-{i}", config.name))
                .io_memory(config.io_memory_bytes)
                // Blocking work (catalog writes) runs on one unpinned thread, not on
                // the pinned core's CPU.
                .blocking_thread_pool_placement(glommio::PoolPlacement::Unbound(1));
            if let Some(spin) = config.spin_before_park {
                builder = builder.spin_before_park(spin);
            }
            let handle = builder
                .spawn(move || async move { body(ctx).await })
                .map_err(|e| RuntimeError::Start {
                    core: i,
                    cpu,
                    reason: e.to_string(),
                });
            match handle {
                Ok(h) => joins.push(h),
                Err(e) => {
                    shutdown.trigger();
                    for h in joins {
                        let _ = h.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(Runtime {
            joins,
            shutdown,
            stats,
        })
    }

    /// The stop signal (e.g. for a SIGTERM handler).
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Asks every core to stop.
    pub fn shutdown(&self) {
        self.shutdown.trigger();
    }

    /// Every core's statistics, in core order.
    pub fn stats(&self) -> &[Arc<CoreStats>] {
        &self.stats
    }

    /// Waits for every core's body to return.
    pub fn join(self) -> Result<(), RuntimeError> {
        let mut first = Ok(());
        for (i, h) in self.joins.into_iter().enumerate() {
            if let Err(e) = h.join()
                && first.is_ok()
            {
                first = Err(RuntimeError::Panicked {
                    core: i,
                    reason: e.to_string(),
                });
            }
        }
        first
    }
}
