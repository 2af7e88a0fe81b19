//! The recent changes of a watched cache shard, held in memory so that watchers that
//! keep up are answered without reading the log.
//!
//! Every watcher of a cache asks its shard's owner for the changes its filter follows
//! since its position, and waits for one when there is none. Read from the log, W watchers
//! of a cache taking R writes a second cost W×R log reads a second. The window holds
//! each put and delete applied since it began, in offset order, up to a bound; a
//! watcher whose position lies inside it is answered from it, one behind it (resuming
//! from an old offset, or fallen back past the bound) from the log, as before.
//!
//! The window exists only while the shard is watched: a watch's start makes it, each of
//! a watch's requests marks it watched, and housekeeping drops it once no watch asked
//! for [`RECENT_IDLE`]. A rebuilt index starts without one. Values are copied in, so
//! what the window holds is what it counts (a value sliced from a larger buffer would
//! keep the whole buffer alive). Each watched cache shard holds up to its own bound:
//! there is no budget per core.

use std::collections::{HashMap, VecDeque};
use std::task::Waker;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{CacheRecord, RecordOp, WatchChange, WatchFilter};

/// Most changes the window holds.
pub const RECENT_MAX_CHANGES: usize = 65_536;
/// Most bytes (keys, values and [`ENTRY_OVERHEAD`] each) the window holds.
pub const RECENT_MAX_BYTES: usize = 8 << 20;
/// How long a window is kept with no watch asking.
pub const RECENT_IDLE: Duration = Duration::from_secs(10);
/// What one change costs the window beyond its key and value.
const ENTRY_OVERHEAD: usize = 64;

/// The puts and deletes applied to a cache shard from `from` on.
#[derive(Debug)]
pub struct Recent {
    /// Every put and delete at or past this offset applied since the window began is
    /// held (the ones below it may not be).
    from: u64,
    changes: VecDeque<WatchChange>,
    bytes: usize,
    /// When a watch last asked.
    watched_at: Instant,
}

impl Recent {
    /// An empty window whose changes begin at `end`, the applied end of the index it
    /// follows (everything below it was applied before the window began), watched at
    /// `now`.
    pub fn new(end: u64, now: Instant) -> Recent {
        Recent {
            from: end,
            changes: VecDeque::new(),
            bytes: 0,
            watched_at: now,
        }
    }

    /// Notes `rec`, applied at `offset` to an index whose applied end was `before` (and
    /// is `after` now).
    pub fn note(&mut self, rec: &CacheRecord, offset: u64, before: u64, after: u64) {
        if offset < before {
            // Applied out of offset order, which the index does not do: start over past
            // it rather than hand a watcher changes out of order (behind, it reads the
            // log).
            *self = Recent::new(after, self.watched_at);
            return;
        }
        if !is_change(rec) {
            return;
        }
        let value = (rec.op == RecordOp::Put).then(|| Bytes::copy_from_slice(&rec.value));
        let size = cost(&rec.key, value.as_ref());
        // Room first, so the queue never grows past its bound.
        while !self.changes.is_empty()
            && (self.bytes + size > RECENT_MAX_BYTES || self.changes.len() >= RECENT_MAX_CHANGES)
        {
            let Some(c) = self.changes.pop_front() else {
                break;
            };
            self.bytes -= cost(&c.key, c.value.as_ref());
            self.from = c.offset + 1;
        }
        self.bytes += size;
        self.changes.push_back(WatchChange {
            key: rec.key.clone(),
            value,
            offset,
            expires_at_ms: if rec.op == RecordOp::Put {
                rec.expires_at_ms
            } else {
                0
            },
        });
    }

    /// The changes `filter` follows in `[from, end)`, about `max_bytes` of them at
    /// most, and where the next read starts; `None` when the window does not hold
    /// every change from `from` (read the log). `end` is the applied end: the window
    /// holds nothing past it.
    pub fn read(
        &mut self,
        from: u64,
        end: u64,
        filter: &WatchFilter,
        max_bytes: usize,
    ) -> Option<(Vec<WatchChange>, u64)> {
        if from < self.from {
            return None;
        }
        let start = self.changes.partition_point(|c| c.offset < from);
        let mut out = Vec::new();
        let mut bytes = 0;
        for c in self.changes.range(start..) {
            if c.offset >= end {
                break;
            }
            if !filter.matches(&c.key) {
                continue;
            }
            if bytes >= max_bytes {
                return Some((out, c.offset));
            }
            bytes += cost(&c.key, c.value.as_ref());
            out.push(c.clone());
        }
        Some((out, end.max(from)))
    }

    /// A watch asked at `now`.
    pub fn watched(&mut self, now: Instant) {
        self.watched_at = self.watched_at.max(now);
    }

    /// Whether no watch asked for `idle` before `now`.
    pub fn idle(&self, now: Instant, idle: Duration) -> bool {
        now.saturating_duration_since(self.watched_at) >= idle
    }
}

/// Whether `rec` is a change a watch delivers: a put or a delete (a compaction's copy
/// restates a value; counters are not cache changes).
pub fn is_change(rec: &CacheRecord) -> bool {
    match rec.op {
        RecordOp::Put => rec.carried.is_none(),
        RecordOp::Delete => true,
        RecordOp::Add(_) | RecordOp::Set(_) | RecordOp::Cut(_) => false,
    }
}

/// The watches of a cache shard waiting for a change, each with its filter: a change
/// wakes only the watches that follow its key (woken by every applied write, W watchers
/// of a cache taking R writes a second were woken W×R times a second, most for keys
/// they do not follow). Watches are found by their key or prefix: a change costs a
/// lookup of its key and one of its key's prefix of each length some prefix watch has,
/// not a look at every watch (prefix watches were scanned, each at every change, until
/// 2026-12-06).
#[derive(Debug, Default)]
pub struct Waiting {
    next: u64,
    /// How many times every watch was told to answer now.
    released: u64,
    /// Watches of exactly one key, by key, then by place.
    by_key: HashMap<String, HashMap<u64, Waker>>,
    /// Watches of a prefix, by prefix, then by place.
    by_prefix: HashMap<String, HashMap<u64, Waker>>,
    /// How many of `by_prefix`'s prefixes have each length (bytes).
    prefix_lengths: std::collections::BTreeMap<usize, usize>,
    /// Watches looked at by wake-ups, for tests of what a change costs.
    #[cfg(test)]
    examined: u64,
    /// Prefixes of changed keys looked up, for the same tests.
    #[cfg(test)]
    prefix_lookups: u64,
}

/// Why a waiting watch was woken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// Look again: a change it follows was applied, or the applied end, the index or
    /// the shard's leadership may have changed otherwise.
    LookAgain,
    /// Answer now, and let the shard go: it is leaving this core or closing.
    Released,
}

impl Waiting {
    /// Wakes (and forgets) the watches that follow `key`.
    pub fn wake_following(&mut self, key: &str) {
        // Emptiness first: a write of a cache nobody watches hashes nothing.
        if !self.by_key.is_empty()
            && let Some(watches) = self.by_key.remove(key)
        {
            #[cfg(test)]
            {
                self.examined += watches.len() as u64;
            }
            for (_, waker) in watches {
                waker.wake();
            }
        }
        // Each length some prefix watch has, from the shortest: a key's prefix of that
        // length, where one ends on a character boundary, is the only one to look up.
        let mut from = 0;
        while from <= key.len()
            && let Some((&len, _)) = self.prefix_lengths.range(from..=key.len()).next()
        {
            from = len + 1;
            if !key.is_char_boundary(len) {
                continue;
            }
            #[cfg(test)]
            {
                self.prefix_lookups += 1;
            }
            let Some(watches) = self.by_prefix.remove(&key[..len]) else {
                continue;
            };
            self.forget_prefix_length(len);
            #[cfg(test)]
            {
                self.examined += watches.len() as u64;
            }
            for (_, waker) in watches {
                waker.wake();
            }
        }
    }

    /// One prefix of `len` bytes is no longer watched.
    fn forget_prefix_length(&mut self, len: usize) {
        if let Some(n) = self.prefix_lengths.get_mut(&len) {
            *n -= 1;
            if *n == 0 {
                self.prefix_lengths.remove(&len);
            }
        }
    }

    /// Wakes (and forgets) every watch to look again: what they wait on may have
    /// changed in another way than a change applied (the index rebuilt, the applied end
    /// moved, leadership lost). The tables' room goes with them.
    pub fn wake_all(&mut self) {
        let (by_key, by_prefix) = (
            std::mem::take(&mut self.by_key),
            std::mem::take(&mut self.by_prefix),
        );
        self.prefix_lengths.clear();
        for waker in
            (by_key.into_values().chain(by_prefix.into_values())).flat_map(HashMap::into_values)
        {
            waker.wake();
        }
    }

    /// Wakes (and forgets) every watch to answer now ([`Wake::Released`]).
    pub fn release_all(&mut self) {
        self.released += 1;
        self.wake_all();
    }

    /// How many watches wait.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        (self.by_key.values().chain(self.by_prefix.values()))
            .map(HashMap::len)
            .sum()
    }

    /// Takes a place for a watch of `filter`.
    fn insert(&mut self, filter: &WatchFilter, waker: &Waker) -> u64 {
        let id = self.next;
        self.next += 1;
        match filter {
            WatchFilter::Key(k) => {
                self.by_key
                    .entry(k.clone())
                    .or_default()
                    .insert(id, waker.clone());
            }
            WatchFilter::Prefix(p) => {
                let watches = self.by_prefix.entry(p.clone()).or_default();
                if watches.is_empty() {
                    *self.prefix_lengths.entry(p.len()).or_default() += 1;
                }
                watches.insert(id, waker.clone());
            }
        }
        id
    }

    /// The waker of the watch at `id`, if it still waits (not woken since).
    fn waker_mut(&mut self, filter: &WatchFilter, id: u64) -> Option<&mut Waker> {
        match filter {
            WatchFilter::Key(k) => self.by_key.get_mut(k)?.get_mut(&id),
            WatchFilter::Prefix(p) => self.by_prefix.get_mut(p)?.get_mut(&id),
        }
    }

    /// Gives up the place at `id`.
    fn remove(&mut self, filter: &WatchFilter, id: u64) {
        match filter {
            WatchFilter::Key(k) => {
                if let Some(watches) = self.by_key.get_mut(k) {
                    watches.remove(&id);
                    if watches.is_empty() {
                        self.by_key.remove(k);
                    }
                }
            }
            WatchFilter::Prefix(p) => {
                if let Some(watches) = self.by_prefix.get_mut(p) {
                    watches.remove(&id);
                    if watches.is_empty() {
                        self.by_prefix.remove(p);
                        self.forget_prefix_length(p.len());
                    }
                }
            }
        }
    }
}

/// Resolves once [`Waiting`] wakes it: a change its filter follows was applied, or
/// every watch was woken.
#[derive(Debug)]
pub struct Woken<'a> {
    waiting: &'a std::cell::RefCell<Waiting>,
    filter: &'a WatchFilter,
    /// Its place, and `released` when it took it.
    id: Option<(u64, u64)>,
}

impl<'a> Woken<'a> {
    /// Waits in `waiting` for a change `filter` follows.
    pub fn new(waiting: &'a std::cell::RefCell<Waiting>, filter: &'a WatchFilter) -> Self {
        Woken {
            waiting,
            filter,
            id: None,
        }
    }
}

impl std::future::Future for Woken<'_> {
    type Output = Wake;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Wake> {
        let this = &mut *self;
        let mut w = this.waiting.borrow_mut();
        match this.id {
            Some((id, all)) => match w.waker_mut(this.filter, id) {
                Some(waker) => waker.clone_from(cx.waker()),
                None => {
                    this.id = None;
                    let why = if w.released == all {
                        Wake::LookAgain
                    } else {
                        Wake::Released
                    };
                    return std::task::Poll::Ready(why);
                }
            },
            None => {
                let id = w.insert(this.filter, cx.waker());
                this.id = Some((id, w.released));
            }
        }
        std::task::Poll::Pending
    }
}

impl Drop for Woken<'_> {
    fn drop(&mut self) {
        if let Some((id, _)) = self.id {
            self.waiting.borrow_mut().remove(self.filter, id);
        }
    }
}

fn cost(key: &str, value: Option<&Bytes>) -> usize {
    key.len() + value.map_or(0, Bytes::len) + ENTRY_OVERHEAD
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, value: &[u8]) -> CacheRecord {
        CacheRecord {
            op: RecordOp::Put,
            expires_at_ms: 0,
            key: key.to_owned(),
            value: Bytes::copy_from_slice(value),
            carried: None,
        }
    }

    fn every() -> WatchFilter {
        WatchFilter::Prefix(String::new())
    }

    /// Notes `rec` applied at `at`, the next offset.
    fn next(r: &mut Recent, rec: &CacheRecord, at: u64) {
        r.note(rec, at, at, at + 1);
    }

    /// Puts and deletes are held in order and handed back by filter; counters and a
    /// compaction's copies are not changes; a position before the window is refused.
    #[test]
    fn the_window_holds_puts_and_deletes_from_where_it_began() {
        let mut r = Recent::new(10, Instant::now());
        let del = CacheRecord {
            op: RecordOp::Delete,
            value: Bytes::new(),
            ..put("a", b"")
        };
        let add = CacheRecord {
            op: RecordOp::Add(3),
            ..put("n", b"")
        };
        let copy = CacheRecord {
            carried: Some(4),
            ..put("b", b"old")
        };
        next(&mut r, &put("a", b"1"), 10);
        next(&mut r, &add, 11);
        next(&mut r, &put("b", b"2"), 12);
        next(&mut r, &copy, 13);
        next(&mut r, &del, 14);
        let (all, end) = r.read(10, 15, &every(), 1 << 20).unwrap();
        let seen: Vec<_> = all.iter().map(|c| (c.offset, c.value.is_some())).collect();
        assert_eq!(seen, [(10, true), (12, true), (14, false)]);
        assert_eq!(end, 15);
        let (a, _) = r
            .read(11, 15, &WatchFilter::Key("a".into()), 1 << 20)
            .unwrap();
        assert_eq!(a.iter().map(|c| c.offset).collect::<Vec<_>>(), [14]);
        // Nothing at or past the applied end is handed out.
        let (upto, end) = r.read(10, 13, &every(), 1 << 20).unwrap();
        assert_eq!((upto.len(), end), (2, 13));
        assert!(
            r.read(9, 15, &every(), 1 << 20).is_none(),
            "before the window"
        );
    }

    /// A bounded answer says where to go on from, and going on from there loses none.
    #[test]
    fn an_answer_over_its_bound_goes_on_where_it_stopped() {
        let mut r = Recent::new(0, Instant::now());
        for i in 0..100u64 {
            next(&mut r, &put(&format!("k{i}"), &[7; 100]), i);
        }
        let (mut from, mut got) = (0, Vec::new());
        while from < 100 {
            let (page, next) = r.read(from, 100, &every(), 1000).unwrap();
            assert!(page.len() < 100 && next > from);
            got.extend(page.into_iter().map(|c| c.offset));
            from = next;
        }
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }

    /// Past its bounds the window lets its oldest changes go, never holding more than
    /// them, and refuses positions before what it still holds.
    #[test]
    fn the_window_is_bounded_in_bytes_and_changes() {
        let mut r = Recent::new(0, Instant::now());
        let big = vec![1u8; 1 << 20];
        for i in 0..10u64 {
            next(&mut r, &put("k", &big), i);
            assert!(r.bytes <= RECENT_MAX_BYTES);
        }
        assert!(r.read(0, 10, &every(), usize::MAX).is_none());
        let (held, _) = r.read(r.from, 10, &every(), usize::MAX).unwrap();
        assert_eq!(held.first().map(|c| c.offset), Some(r.from));
        assert_eq!(held.len() as u64, 10 - r.from);

        let mut r = Recent::new(0, Instant::now());
        let n = RECENT_MAX_CHANGES as u64 + 100;
        for i in 0..n {
            next(&mut r, &put("k", b"v"), i);
        }
        assert_eq!(r.changes.len(), RECENT_MAX_CHANGES);
        assert!(
            r.changes.capacity() < 2 * RECENT_MAX_CHANGES,
            "the queue grew past its bound"
        );
        assert_eq!(r.from, n - RECENT_MAX_CHANGES as u64);
        assert!(r.read(r.from - 1, n, &every(), 1).is_none());
    }

    /// A change noted below the applied end (out of offset order: after a counter's
    /// add at a later offset, say) starts the window over past it, so no watcher is
    /// handed changes out of order or missing.
    #[test]
    fn a_change_out_of_order_starts_the_window_over() {
        let mut r = Recent::new(0, Instant::now());
        next(&mut r, &put("a", b"1"), 3);
        let add = CacheRecord {
            op: RecordOp::Add(1),
            ..put("n", b"")
        };
        next(&mut r, &add, 5);
        r.note(&put("a", b"2"), 4, 6, 6);
        assert!(r.read(0, 6, &every(), 1 << 20).is_none());
        assert!(r.read(3, 6, &every(), 1 << 20).is_none());
        assert_eq!(r.read(6, 6, &every(), 1 << 20).unwrap().0.len(), 0);
    }

    /// Idle once no watch asked for the idle time.
    #[test]
    fn a_window_is_idle_once_no_watch_asks() {
        let t0 = Instant::now();
        let mut r = Recent::new(0, t0);
        assert!(!r.idle(t0 + RECENT_IDLE / 2, RECENT_IDLE));
        r.watched(t0 + RECENT_IDLE / 2);
        assert!(!r.idle(t0 + RECENT_IDLE, RECENT_IDLE));
        assert!(r.idle(t0 + RECENT_IDLE * 2, RECENT_IDLE));
    }

    /// A watch of each filter, each polled once (waiting), with what counts its wake-ups.
    #[allow(clippy::type_complexity)]
    fn all_waiting<'a>(
        waiting: &'a std::cell::RefCell<Waiting>,
        filters: &'a [WatchFilter],
    ) -> (Vec<crate::wakes::Wakes>, Vec<std::pin::Pin<Box<Woken<'a>>>>) {
        use std::future::Future;
        let wakes: Vec<_> = filters.iter().map(|_| crate::wakes::Wakes::new()).collect();
        let mut woken: Vec<_> = filters
            .iter()
            .map(|f| Box::pin(Woken::new(waiting, f)))
            .collect();
        for (w, wakes) in woken.iter_mut().zip(&wakes) {
            assert!(w.as_mut().poll(&mut wakes.cx()).is_pending());
        }
        (wakes, woken)
    }

    /// Which of the watches were woken.
    fn woken_since(wakes: &[crate::wakes::Wakes]) -> Vec<usize> {
        (wakes.iter().enumerate())
            .filter(|(_, w)| w.count() > 0)
            .map(|(i, _)| i)
            .collect()
    }

    /// A change looks at the watches of its key and of its prefixes, not at every
    /// watch: with 1,000 watches of other keys waiting, a put wakes its key's two
    /// watches and the prefix watch it matches, looking at those three only; a dropped
    /// watch leaves nothing behind; a release wakes the rest to answer now.
    #[test]
    fn a_change_looks_only_at_its_keys_watches_and_its_prefixes() {
        use std::future::Future;
        let waiting = std::cell::RefCell::new(Waiting::default());
        let mut filters: Vec<WatchFilter> = (0..1000)
            .map(|i| WatchFilter::Key(format!("other-{i}")))
            .collect();
        filters.extend([
            WatchFilter::Key("k".into()),
            WatchFilter::Key("k".into()),
            WatchFilter::Prefix("k".into()),
            WatchFilter::Prefix("z".into()),
        ]);
        let (wakes, mut woken) = all_waiting(&waiting, &filters);
        assert_eq!(waiting.borrow().len(), 1004);
        waiting.borrow_mut().wake_following("k");
        let woken_ones = woken_since(&wakes);
        assert_eq!(
            woken_ones,
            [1000, 1001, 1002],
            "its key's watches and its prefix's"
        );
        assert_eq!(
            waiting.borrow().examined,
            3,
            "two of the key, one of its prefix"
        );
        for i in [1000, 1001, 1002] {
            assert_eq!(
                woken[i].as_mut().poll(&mut wakes[i].cx()),
                std::task::Poll::Ready(Wake::LookAgain)
            );
        }
        // A watch given up takes its place with it, and its key's entry when the last.
        woken.remove(7);
        assert_eq!(waiting.borrow().len(), 1000);
        assert!(!waiting.borrow().by_key.contains_key("other-7"));
        waiting.borrow_mut().release_all();
        assert_eq!(waiting.borrow().len(), 0);
        assert_eq!(
            woken[0].as_mut().poll(&mut wakes[0].cx()),
            std::task::Poll::Ready(Wake::Released)
        );
    }

    /// Prefix watches are found by prefix: with 1,000 watches of other prefixes (of
    /// three lengths) waiting, a change wakes exactly the watches of its key's prefixes
    /// (its own `user/42/`, the empty one, one of two bytes with two watches) and looks
    /// up its prefix of each length watched, 7, and nothing else; a
    /// length falling inside a character of the key is passed over (slicing there
    /// would panic), as are keys shorter than every prefix; a prefix whose last watch
    /// was dropped or woken takes its length with it.
    #[test]
    fn a_change_looks_only_at_the_prefix_watches_it_matches() {
        let waiting = std::cell::RefCell::new(Waiting::default());
        let mut filters: Vec<WatchFilter> = (0..1000)
            .map(|i| WatchFilter::Prefix(format!("user/{i}/")))
            .collect();
        filters.extend([
            WatchFilter::Prefix(String::new()),
            WatchFilter::Prefix("us".into()),
            WatchFilter::Prefix("us".into()),
            WatchFilter::Prefix("usé".into()),
            WatchFilter::Prefix("user/7".into()),
        ]);
        let (wakes, woken) = all_waiting(&waiting, &filters);
        waiting.borrow_mut().wake_following("user/42/name");
        let woken_ones = woken_since(&wakes);
        assert_eq!(woken_ones, [42, 1000, 1001, 1002]);
        assert_eq!(waiting.borrow().examined, 4, "the four that follow it");
        assert_eq!(
            waiting.borrow().prefix_lookups,
            7,
            "lengths 0, 2, 4, 6, 7, 8, 9"
        );
        assert_eq!(waiting.borrow().len(), 1001);
        // "us" woke both its watches and went, and "" its one: two lengths fewer.
        let lengths: Vec<usize> = waiting.borrow().prefix_lengths.keys().copied().collect();
        assert_eq!(lengths, [4, 6, 7, 8, 9]);
        // Length 4 falls inside the second "é" of "aéé" (5 bytes); "usè" is another
        // 4-byte key; "u" and "" are shorter than every prefix left.
        for key in ["a\u{e9}\u{e9}", "us\u{e8}", "u", ""] {
            waiting.borrow_mut().wake_following(key);
            assert_eq!(waiting.borrow().len(), 1001, "{key:?} woke a watch");
        }
        waiting.borrow_mut().wake_following("usé!");
        assert_eq!(wakes[1003].count(), 1);
        drop(woken);
        assert_eq!(waiting.borrow().len(), 0);
        assert!(waiting.borrow().prefix_lengths.is_empty());
    }
}
