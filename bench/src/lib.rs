//! The benchmark tool. Not built yet: see issue 8.
