//! Unfinished frames, bounded per connection.
//!
//! A stream's reader holds the bytes of a frame until the frame is whole, and a frame
//! may be as large as the frame limit (16 MiB). QUIC's flow control bounds only what
//! the broker has not read yet, so a client that opens many streams and leaves a large
//! frame unfinished on each would have the broker hold the frame limit times the stream
//! limit (1,024 streams: 16 GiB) for one connection.
//!
//! [`PartialFrames`] bounds what a connection's readers hold together. Below the budget
//! any stream reads. At or past it, one stream holding part of a frame (the *head*)
//! goes on reading until it has finished that frame, and the others wait without
//! reading, so QUIC's flow control stops the client sending to them. The head always
//! makes progress (nothing it waits for is held by another stream), so a client that
//! writes whole frames, as every well-behaved one does, is never deadlocked, only slowed
//! while it is over budget. A stream holding nothing never becomes the head: a
//! subscription's stream, on which the client sends nothing more, would hold the
//! connection's other streams forever.
//! A connection's readers hold at most the budget, one frame at the head, and what
//! reads already under way return (the QUIC connection receive window).

/// A connection's unfinished-frame bytes and the stream let past the budget.
#[derive(Debug)]
pub struct PartialFrames {
    held: usize,
    budget: usize,
    head: Option<u64>,
}

impl PartialFrames {
    /// A connection whose readers may hold `budget` bytes together.
    pub fn new(budget: usize) -> PartialFrames {
        PartialFrames {
            held: 0,
            budget,
            head: None,
        }
    }

    /// Whether stream `id`, its reader holding `holding` bytes, may read more now. Past
    /// the budget the first stream holding part of a frame to ask becomes the head, and
    /// only it may, until [`PartialFrames::frame_done`].
    pub fn may_read(&mut self, id: u64, holding: usize) -> bool {
        if self.held < self.budget {
            return true;
        }
        match self.head {
            Some(head) => head == id,
            None if holding > 0 => {
                self.head = Some(id);
                true
            }
            None => false,
        }
    }

    /// A stream's reader went from holding `before` bytes to `after`. True when that
    /// may let a waiting stream read (the total fell below the budget).
    pub fn counted(&mut self, before: usize, after: usize) -> bool {
        self.held = self.held - before + after;
        after < before && self.held < self.budget
    }

    /// Stream `id` finished a frame or ended. True when it was the head (a waiting
    /// stream may become the next).
    pub fn frame_done(&mut self, id: u64) -> bool {
        if self.head == Some(id) {
            self.head = None;
            return true;
        }
        false
    }

    /// Bytes the readers hold.
    pub fn held(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_the_budget_every_stream_reads() {
        let mut p = PartialFrames::new(100);
        assert!(p.may_read(1, 0));
        p.counted(0, 60);
        assert!(p.may_read(2, 0));
        p.counted(0, 39);
        assert!(p.may_read(3, 0));
        assert_eq!(p.held(), 99);
    }

    #[test]
    fn past_the_budget_only_the_head_reads_until_it_finishes_a_frame() {
        let mut p = PartialFrames::new(100);
        p.counted(0, 70);
        p.counted(0, 40);
        // Stream 2 asks first past the budget: it is the head.
        assert!(p.may_read(2, 40));
        assert!(!p.may_read(1, 70));
        assert!(!p.may_read(3, 0));
        // The head reads on past the budget.
        p.counted(40, 90);
        assert!(p.may_read(2, 90));
        assert!(!p.may_read(1, 70));
        // Its frame is whole: 90 bytes leave its reader, and it is head no more.
        assert!(p.frame_done(2));
        assert!(p.counted(90, 0), "the total fell below the budget");
        assert!(p.may_read(1, 70));
        assert!(p.may_read(3, 0));
    }

    #[test]
    fn a_finished_head_hands_over_even_when_the_total_stays_over() {
        let mut p = PartialFrames::new(100);
        p.counted(0, 100);
        p.counted(0, 50);
        assert!(p.may_read(1, 100));
        assert!(!p.may_read(2, 50));
        assert!(!p.frame_done(2), "not the head");
        assert!(p.frame_done(1));
        // Still over the budget: the next stream to ask leads.
        assert!(p.may_read(2, 50));
        assert!(!p.may_read(1, 100));
    }

    #[test]
    fn a_stream_that_ends_gives_back_what_it_held() {
        let mut p = PartialFrames::new(100);
        p.counted(0, 120);
        assert!(p.may_read(7, 120));
        // Stream 7 ends mid-frame: its bytes are dropped, and it is head no more.
        assert!(p.counted(120, 0));
        assert!(p.frame_done(7));
        assert_eq!(p.held(), 0);
        assert!(p.may_read(8, 0));
    }

    /// A subscription's stream, read to its end of frame and then waiting on a client
    /// that sends nothing more, would never hand the head over.
    #[test]
    fn a_stream_holding_nothing_never_becomes_the_head() {
        let mut p = PartialFrames::new(100);
        p.counted(0, 100);
        assert!(!p.may_read(1, 0));
        assert!(p.may_read(2, 100), "the stream holding the bytes leads");
        assert!(!p.may_read(1, 0));
    }
}
