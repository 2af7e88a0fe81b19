//! The durable segment log. Not built yet: see issue 3.
