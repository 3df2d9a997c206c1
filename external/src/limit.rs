//! [`InFlightLimit`]: a counting semaphore with a deadline.

use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// A counting semaphore bounding the requests in flight to one external program.
#[derive(Debug)]
pub struct InFlightLimit {
    in_flight: Mutex<usize>,
    freed: Condvar,
    max: usize,
}

/// A held slot; released on drop.
#[derive(Debug)]
pub struct InFlightSlot<'a> {
    limit: &'a InFlightLimit,
}

impl InFlightLimit {
    /// A limit of `max` concurrent requests (at least 1).
    pub fn new(max: usize) -> Self {
        Self {
            in_flight: Mutex::new(0),
            freed: Condvar::new(),
            max: max.max(1),
        }
    }

    /// Waits for a free slot until `deadline`; `None` if none became free in time.
    pub fn acquire_until(&self, deadline: Instant) -> Option<InFlightSlot<'_>> {
        let mut in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while *in_flight >= self.max {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            in_flight = self
                .freed
                .wait_timeout(in_flight, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        *in_flight += 1;
        Some(InFlightSlot { limit: self })
    }

    /// Requests currently in flight.
    pub fn in_flight(&self) -> usize {
        *self
            .in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for InFlightSlot<'_> {
    fn drop(&mut self) {
        let mut in_flight = self
            .limit
            .in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *in_flight -= 1;
        self.limit.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn in_flight_limit_blocks_until_deadline() {
        let limit = InFlightLimit::new(2);
        let far = Instant::now() + Duration::from_secs(5);
        let first = limit.acquire_until(far).unwrap();
        let _second = limit.acquire_until(far).unwrap();
        let started = Instant::now();
        assert!(limit
            .acquire_until(Instant::now() + Duration::from_millis(30))
            .is_none());
        assert!(started.elapsed() >= Duration::from_millis(30));
        drop(first);
        assert_eq!(limit.in_flight(), 1);
        assert!(limit.acquire_until(Instant::now()).is_some());
    }
}
