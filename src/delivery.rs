//! A delivery: one stream entry on its way through the worker, with what has
//! happened to it so far in this process.

use std::sync::Arc;
use std::time::SystemTime;

use crate::event::{Event, Fields, Invalid};

/// One failed attempt, kept for the dead-letter history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    /// 1-based attempt number across deliveries.
    pub attempt: u32,
    /// When it failed; `None` for an earlier delivery that never reported
    /// (the consumer stopped or crashed during it).
    pub at: Option<SystemTime>,
    /// What went wrong.
    pub error: String,
}

/// An entry read from a stream, valid or not.
#[derive(Debug)]
pub(crate) struct Delivery {
    pub stream: Arc<str>,
    pub entry_id: String,
    pub body: Result<Event, (Fields, Invalid)>,
    /// Deliveries that reached a worker, this one included: the Redis
    /// delivery count, lowered by `Processor::count_start` for redeliveries
    /// that never started (entries queued behind a crash).
    pub delivery_count: u64,
    /// Failed attempts in this process.
    pub failures: Vec<Attempt>,
}

/// What the channel to the workers carries: entries of one stream.
pub(crate) type Job = Vec<Delivery>;

impl Delivery {
    pub fn key(&self) -> String {
        crate::in_flight::key(&self.stream, &self.entry_id)
    }

    pub fn event_id(&self) -> Option<&str> {
        match &self.body {
            Ok(event) => Some(event.event_id()),
            Err((fields, _)) => fields
                .iter()
                .find(|(k, _)| k == b"event_id")
                .and_then(|(_, v)| std::str::from_utf8(v).ok()),
        }
    }

    /// Attempts made before this delivery: each earlier delivery that did not
    /// finish counts as one (it crashed or was stopped).
    pub fn prior_attempts(&self) -> u32 {
        u32::try_from(self.delivery_count.saturating_sub(1)).unwrap_or(u32::MAX)
    }

    /// Attempts so far, failed ones in this process included.
    pub fn attempts(&self) -> u32 {
        self.prior_attempts()
            .saturating_add(u32::try_from(self.failures.len()).unwrap_or(u32::MAX))
    }

    /// The full history: unreported earlier deliveries, then this process's
    /// failures.
    pub fn history(&self) -> Vec<Attempt> {
        let mut history: Vec<Attempt> = (1..=self.prior_attempts())
            .map(|attempt| Attempt {
                attempt,
                at: None,
                error: "delivered but never finished (the consumer stopped or crashed)".into(),
            })
            .collect();
        history.extend(self.failures.iter().cloned());
        history
    }
}
