//! The Felix broker. Not built yet: see issue 5 (single-node broker).
