//! A waker that counts its wake-ups, for tests that poll futures by hand.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Wake, Waker};

/// Counts the times its [`Waker`] was woken.
pub struct Wakes {
    count: Arc<Count>,
    waker: Waker,
}

struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

impl Wakes {
    /// A waker not woken yet.
    pub fn new() -> Wakes {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        Wakes {
            waker: Waker::from(count.clone()),
            count,
        }
    }

    /// The waker.
    pub fn waker(&self) -> &Waker {
        &self.waker
    }

    /// A context to poll with.
    pub fn cx(&self) -> Context<'_> {
        Context::from_waker(&self.waker)
    }

    /// Wake-ups so far.
    pub fn count(&self) -> usize {
        self.count.0.load(Ordering::Relaxed)
    }
}
