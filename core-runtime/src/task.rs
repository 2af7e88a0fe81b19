//! Tasks and timers on the current core's executor, so crates above this one never name
//! the executor library.

use std::future::Future;
use std::time::Duration;

/// A spawned task on the current core. Awaiting it yields its output; dropping it
/// cancels it unless it was detached.
#[derive(Debug)]
pub struct Task<T>(glommio::Task<T>);

impl<T> Task<T> {
    /// Lets the task run to completion on its own.
    pub fn detach(self) {
        self.0.detach();
    }
}

impl<T> Future for Task<T> {
    type Output = T;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<T> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

/// Spawns `f` on the current core.
pub fn spawn<F>(f: F) -> Task<F::Output>
where
    F: Future + 'static,
    F::Output: 'static,
{
    Task(glommio::spawn_local(f))
}

/// Runs blocking `f` (file I/O, fsync) on the executor's blocking thread, off the core
/// thread, and resolves with its result.
pub async fn spawn_blocking<F, R>(f: F) -> R
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    glommio::executor().spawn_blocking(f).await
}

/// Sleeps on the current core's timer.
pub async fn sleep(d: Duration) {
    glommio::timer::sleep(d).await;
}

/// Yields to other tasks on this core.
pub async fn yield_now() {
    futures_lite::future::yield_now().await;
}

/// Runs `f` with a deadline; `None` when it ran out.
pub async fn timeout<F: Future>(d: Duration, f: F) -> Option<F::Output> {
    futures_lite::future::or(async { Some(f.await) }, async {
        glommio::timer::sleep(d).await;
        None
    })
    .await
}

/// Runs a single future on a fresh, unpinned executor on this thread (tools and tests).
pub fn block_on<F: Future>(f: F) -> F::Output {
    glommio::LocalExecutorBuilder::default()
        .io_memory(2 << 20)
        .make()
        .expect("an executor starts")
        .run(f)
}
