//! The Felix SDK. Not built yet: see issue 7.
