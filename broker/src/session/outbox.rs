//! A stream's answers, in request order and bounded, and a connection's budget of
//! publish bytes in flight. No I/O: the driver pushes answers as it dispatches, and its
//! writer takes whatever is ready at the head in one batch.
//!
//! Bounds, and what happens at each:
//! - Every answer, of every kind, holds a slot from the moment its request is read until
//!   the answer is handed to QUIC. At `window` slots the driver stops reading the stream,
//!   so QUIC flow control pushes back on the client: a client that never reads its
//!   answers stalls itself, never the broker's memory. (The protocol's publish window is
//!   this bound; non-publish answers count too.)
//! - Publish payload bytes in flight on a connection, answered or not, are bounded by a
//!   [`ByteBudget`]: past it the driver stops reading publishes until earlier ones
//!   complete. Nothing is refused, so nothing acknowledged is at stake.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;

/// An answer that may not be known yet.
pub enum Answer {
    /// Known now (`None`: the request resolved without an answer).
    Ready(Option<Bytes>),
    /// Known when the future resolves.
    Pending(Pin<Box<dyn Future<Output = Option<Bytes>>>>),
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Ready(b) => f
                .debug_tuple("Ready")
                .field(&b.as_ref().map(Bytes::len))
                .finish(),
            Answer::Pending(_) => f.write_str("Pending"),
        }
    }
}

/// A stream's answers in request order.
#[derive(Debug)]
pub struct Outbox {
    queue: VecDeque<Answer>,
    window: usize,
    closed: bool,
}

/// What the writer should do.
#[derive(Debug, PartialEq, Eq)]
pub enum Flush {
    /// Write these frames (in order), then ask again.
    Write,
    /// Nothing ready at the head; wait.
    Wait,
    /// Closed and everything answered: finish the stream.
    Done,
}

impl Outbox {
    /// An outbox holding at most `window` unanswered requests (at least 1).
    pub fn new(window: usize) -> Outbox {
        Outbox {
            queue: VecDeque::new(),
            window: window.max(1),
            closed: false,
        }
    }

    /// Whether another request may be read (its answer would fit).
    pub fn has_room(&self) -> bool {
        self.queue.len() < self.window
    }

    /// Requests read whose answers are not yet handed to QUIC.
    pub fn unanswered(&self) -> usize {
        self.queue.len()
    }

    /// Queues the answer to the request just read. The driver only reads a request when
    /// [`Outbox::has_room`], so the queue never passes the window.
    pub fn push(&mut self, answer: Answer) {
        debug_assert!(self.queue.len() < self.window, "read past the window");
        self.queue.push_back(answer);
    }

    /// No more requests will come; the writer finishes once the rest are answered.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// Whether [`Outbox::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Moves every answer ready at the head into `out` (polling pending ones in order,
    /// stopping at the first still pending), up to `max` frames.
    pub fn poll_flush(&mut self, cx: &mut Context<'_>, out: &mut Vec<Bytes>, max: usize) -> Flush {
        let before = out.len();
        let mut resolved = false;
        while out.len() - before < max {
            let Some(front) = self.queue.front_mut() else {
                break;
            };
            let frame = match front {
                Answer::Ready(frame) => frame.take(),
                Answer::Pending(fut) => match fut.as_mut().poll(cx) {
                    Poll::Ready(frame) => frame,
                    Poll::Pending => break,
                },
            };
            self.queue.pop_front();
            resolved = true;
            out.extend(frame);
        }
        if out.len() > before || resolved {
            Flush::Write
        } else if self.closed && self.queue.is_empty() {
            Flush::Done
        } else {
            Flush::Wait
        }
    }
}

/// A connection's publish payload bytes in flight (read but not yet appended or
/// refused).
#[derive(Debug, Clone, Copy)]
pub struct ByteBudget {
    used: usize,
    max: usize,
}

impl ByteBudget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> ByteBudget {
        ByteBudget { used: 0, max }
    }

    /// Takes `n` bytes if they fit. An empty budget always admits one request, so a
    /// single publish larger than the budget (but within the frame limit) still goes.
    pub fn try_take(&mut self, n: usize) -> bool {
        if self.used == 0 || self.used + n <= self.max {
            self.used += n;
            true
        } else {
            false
        }
    }

    /// Gives back `n` bytes taken earlier.
    pub fn release(&mut self, n: usize) {
        debug_assert!(n <= self.used);
        self.used = self.used.saturating_sub(n);
    }

    /// Bytes in flight.
    pub fn used(&self) -> usize {
        self.used
    }
}

/// Bytes in flight shared by many takers, handed out in arrival order: once one waits,
/// later ones queue behind it (small requests do not overtake a large one for good),
/// and a release wakes only the first in line, who wakes the next once it took its
/// share (a release costs a wake-up, not one per waiter).
#[derive(Debug)]
pub struct FifoBytes {
    budget: ByteBudget,
    /// Waiting takers by arrival: their bytes and whom to wake.
    waiting: std::collections::BTreeMap<u64, (usize, Option<Waker>)>,
    next: u64,
}

impl FifoBytes {
    /// `max` bytes.
    pub fn new(max: usize) -> FifoBytes {
        FifoBytes {
            budget: ByteBudget::new(max),
            waiting: Default::default(),
            next: 0,
        }
    }

    /// Takes `n` bytes now if nobody waits and they fit.
    pub fn try_take(&mut self, n: usize) -> bool {
        self.waiting.is_empty() && self.budget.try_take(n)
    }

    /// Queues a taker of `n` bytes; returns its place.
    pub fn queue(&mut self, n: usize) -> u64 {
        let ticket = self.next;
        self.next += 1;
        self.waiting.insert(ticket, (n, None));
        ticket
    }

    /// Takes the bytes of `ticket` if it is first in line and they fit, waking the next
    /// in line; else `waker` is woken when its turn may have come.
    pub fn poll_take(&mut self, ticket: u64, waker: &Waker) -> bool {
        let first = self.waiting.first_key_value().map(|(t, (n, _))| (*t, *n));
        if let Some((t, n)) = first
            && t == ticket
            && self.budget.try_take(n)
        {
            self.waiting.remove(&ticket);
            self.wake_first();
            return true;
        }
        if let Some((_, w)) = self.waiting.get_mut(&ticket) {
            *w = Some(waker.clone());
        }
        false
    }

    /// `ticket` leaves the line unserved.
    pub fn leave(&mut self, ticket: u64) {
        let was_first = self
            .waiting
            .first_key_value()
            .is_some_and(|(t, _)| *t == ticket);
        self.waiting.remove(&ticket);
        if was_first {
            self.wake_first();
        }
    }

    /// Gives back `n` bytes.
    pub fn release(&mut self, n: usize) {
        self.budget.release(n);
        self.wake_first();
    }

    /// Bytes in flight.
    pub fn used(&self) -> usize {
        self.budget.used()
    }

    fn wake_first(&mut self) {
        if let Some((_, (_, w))) = self.waiting.iter_mut().next()
            && let Some(w) = w.take()
        {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;
    use std::task::Waker;

    use super::*;

    fn cx() -> Context<'static> {
        Context::from_waker(Waker::noop())
    }

    /// A future resolved by hand.
    fn later(slot: &Rc<Cell<Option<&'static str>>>) -> Answer {
        let slot = slot.clone();
        Answer::Pending(Box::pin(std::future::poll_fn(move |_| match slot.take() {
            Some(s) => Poll::Ready(Some(Bytes::from_static(s.as_bytes()))),
            None => Poll::Pending,
        })))
    }

    /// A waiting taker is served before later ones, whatever their size, and a release
    /// wakes the first in line only.
    #[test]
    fn shared_bytes_go_in_arrival_order() {
        let mut b = FifoBytes::new(10);
        assert!(b.try_take(8));
        let large = b.queue(6);
        assert!(
            !b.try_take(1),
            "a small one does not pass the large one waiting"
        );
        let small = b.queue(1);
        let (large_wakes, small_wakes) = (crate::wakes::Wakes::new(), crate::wakes::Wakes::new());
        let (wl, ws) = (large_wakes.waker(), small_wakes.waker());
        assert!(!b.poll_take(large, wl));
        assert!(!b.poll_take(small, ws), "not its turn");
        b.release(8);
        assert_eq!(large_wakes.count(), 1, "the first in line is woken");
        assert!(b.poll_take(large, wl));
        assert!(b.poll_take(small, ws), "its turn now, and it fits");
        assert_eq!(b.used(), 7);
        // One that leaves first in line hands its turn on.
        let first = b.queue(5);
        let second = b.queue(1);
        b.leave(first);
        assert!(b.poll_take(second, ws));
    }

    #[test]
    fn answers_leave_in_request_order_whatever_order_they_resolve_in() {
        let mut o = Outbox::new(8);
        let (a, b) = (Rc::new(Cell::new(None)), Rc::new(Cell::new(None)));
        o.push(later(&a));
        o.push(later(&b));
        o.push(Answer::Ready(Some(Bytes::from_static(b"c"))));
        let mut out = Vec::new();
        b.set(Some("b"));
        assert_eq!(
            o.poll_flush(&mut cx(), &mut out, 64),
            Flush::Wait,
            "a blocks b and c"
        );
        assert!(out.is_empty());
        a.set(Some("a"));
        assert_eq!(o.poll_flush(&mut cx(), &mut out, 64), Flush::Write);
        assert_eq!(out, [&b"a"[..], b"b", b"c"], "one batch, in order");
        assert_eq!(o.unanswered(), 0);
    }

    #[test]
    fn every_kind_of_answer_counts_against_the_window() {
        let mut o = Outbox::new(2);
        let pending = Rc::new(Cell::new(None));
        o.push(Answer::Ready(Some(Bytes::from_static(b"error frame"))));
        assert!(o.has_room());
        o.push(later(&pending));
        assert!(
            !o.has_room(),
            "a ready answer not yet written holds its slot"
        );
        let mut out = Vec::new();
        assert_eq!(o.poll_flush(&mut cx(), &mut out, 64), Flush::Write);
        assert!(o.has_room(), "writing it frees the slot");
        assert!(o.poll_flush(&mut cx(), &mut Vec::new(), 64) == Flush::Wait);
    }

    #[test]
    fn answerless_requests_free_their_slot_and_close_waits_for_the_rest() {
        let mut o = Outbox::new(4);
        let p = Rc::new(Cell::new(None));
        o.push(Answer::Ready(None));
        o.push(later(&p));
        o.close();
        let mut out = Vec::new();
        assert_eq!(
            o.poll_flush(&mut cx(), &mut out, 64),
            Flush::Write,
            "the empty answer is consumed"
        );
        assert!(out.is_empty());
        assert_eq!(
            o.poll_flush(&mut cx(), &mut out, 64),
            Flush::Wait,
            "closed, one still owed"
        );
        p.set(Some("x"));
        assert_eq!(o.poll_flush(&mut cx(), &mut out, 64), Flush::Write);
        assert_eq!(o.poll_flush(&mut cx(), &mut out, 64), Flush::Done);
    }

    #[test]
    fn a_flush_takes_at_most_max_frames() {
        let mut o = Outbox::new(8);
        for _ in 0..5 {
            o.push(Answer::Ready(Some(Bytes::from_static(b"x"))));
        }
        let mut out = Vec::new();
        o.poll_flush(&mut cx(), &mut out, 3);
        assert_eq!(out.len(), 3);
        assert_eq!(o.unanswered(), 2);
    }

    #[test]
    fn the_byte_budget_admits_one_oversized_request_and_then_waits() {
        let mut b = ByteBudget::new(100);
        assert!(b.try_take(60));
        assert!(b.try_take(40));
        assert!(!b.try_take(1), "full");
        b.release(100);
        assert!(b.try_take(1_000), "an empty budget admits one big request");
        assert!(!b.try_take(1));
        b.release(1_000);
        assert_eq!(b.used(), 0);
    }
}
