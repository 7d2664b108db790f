//! Adding events to a stream: what `taskhub produce` does, and a helper for
//! programs and tests that publish events.

use crate::error::{Error, ErrorKind};
use crate::net::REDIS_COMMAND_TIMEOUT;
use crate::redis::{RedisClient, RedisConn};
use crate::tls::Tls;

/// Publishes events to one stream. A send that fails returns the error (the
/// caller decides whether to try again); the next send reconnects if the
/// connection was lost.
pub struct Producer {
    client: RedisClient,
    conn: RedisConn,
    stream: String,
}

impl Producer {
    /// Connects to Redis at `redis_url` (with `tls` for a `rediss://` URL;
    /// `Tls::default()` is the system's trust store) to publish to `stream`.
    pub fn connect(redis_url: &str, tls: &Tls, stream: &str) -> Result<Producer, Error> {
        let client = RedisClient::open(redis_url, tls)?;
        let conn = client
            .connect(REDIS_COMMAND_TIMEOUT)
            .map_err(|e| crate::redis::redis_unreachable(redis_url, e))?;
        Ok(Producer {
            client,
            conn,
            stream: stream.to_owned(),
        })
    }

    /// Adds one entry with the given fields and returns its entry id.
    pub fn send<K, V>(&mut self, fields: &[(K, V)]) -> Result<String, Error>
    where
        K: redis::ToRedisArgs,
        V: redis::ToRedisArgs,
    {
        Ok(self.send_batch(std::slice::from_ref(&fields))?.remove(0))
    }

    /// Adds several entries in one round trip and returns their entry ids.
    ///
    /// The slice goes as one pipeline: it is encoded in memory and written
    /// in full before any reply is read, and the replies wait in Redis
    /// until then. To send many thousands of entries, call this on slices
    /// of a few hundred to a thousand.
    pub fn send_batch<K, V, F>(&mut self, entries: &[F]) -> Result<Vec<String>, Error>
    where
        K: redis::ToRedisArgs,
        V: redis::ToRedisArgs,
        F: AsRef<[(K, V)]>,
    {
        if self.conn.is_broken() {
            self.conn = self.client.connect(REDIS_COMMAND_TIMEOUT).map_err(|e| {
                Error::with_source(
                    ErrorKind::Redis,
                    format!("{}: reconnect failed", self.stream),
                    e,
                )
            })?;
        }
        let mut pipe = self.conn.pipe();
        for fields in entries {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&self.stream).arg("*");
            for (k, v) in fields.as_ref() {
                cmd.arg(k).arg(v);
            }
            pipe.add_command(cmd);
        }
        pipe.query(&mut self.conn).map_err(|e| {
            Error::with_source(ErrorKind::Redis, format!("{}: XADD failed", self.stream), e)
        })
    }

    /// Adds one event (`event_id` and optional `payload`), returns its entry id.
    pub fn send_event(&mut self, event_id: &str, payload: Option<&str>) -> Result<String, Error> {
        match payload {
            Some(p) => self.send(&[("event_id", event_id), ("payload", p)]),
            None => self.send(&[("event_id", event_id)]),
        }
    }
}
