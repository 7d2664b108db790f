//! Where Redis connections come from: [`RedisClient`] opens one server or a
//! Redis Cluster, found out from the URL, and checks the cluster rules.

use std::time::Duration;

use redis::cluster::ClusterClient;
use redis::RedisResult;

use crate::error::{Error, ErrorKind};
use crate::net::{CONNECT_TIMEOUT, REDIS_COMMAND_TIMEOUT};
use crate::redact::redact;
use crate::redis::conn::RedisConn;
use crate::tls::Tls;

/// Where connections come from: one server or a cluster, found out when
/// opened.
#[derive(Clone)]
pub(crate) enum RedisClient {
    Single(redis::Client),
    Cluster(ClusterClient),
}

impl RedisClient {
    /// Opens `url`: one URL, or several separated by commas (the seed nodes
    /// of a cluster). With one URL, asks the server (`INFO cluster`) whether
    /// it is a cluster node, so the same `--redis-url` works when a single
    /// server grows into a cluster. `rediss://` URLs use `tls` (one server
    /// and a cluster alike). Fails when the server cannot be reached.
    pub fn open(url: &str, tls: &Tls) -> Result<RedisClient, Error> {
        let urls: Vec<&str> = url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        if !tls.is_default() && urls.first().is_some_and(|u| !is_tls_url(u)) {
            log::warn!("redis: TLS files are set but the URL is not rediss://; they are not used");
        }
        let first = match urls.as_slice() {
            [] => {
                return Err(Error::new(ErrorKind::Config, "the Redis URL is empty"));
            }
            [one] => *one,
            many => return cluster_client(url, many, tls),
        };
        let client = redis_client(first, tls)?;
        let mut conn = client
            .get_connection_with_timeout(CONNECT_TIMEOUT)
            .and_then(|c| {
                c.set_read_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
                Ok(c)
            })
            .map_err(|e| connect_failed(url, e))?;
        let cluster = match redis::cmd("INFO").arg("cluster").query::<String>(&mut conn) {
            Ok(info) => info.contains("cluster_enabled:1"),
            // INFO (@dangerous) may be refused to an ACL user; CLUSTER INFO
            // is often allowed, and fails on a server without cluster mode.
            Err(e) if e.code() == Some("NOPERM") => {
                match redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut conn) {
                    Ok(info) => info.contains("cluster_state"),
                    Err(e) if crate::redis::is_outage(&e) => {
                        return Err(crate::redis::redis_unreachable(url, e))
                    }
                    Err(e) if e.code() == Some("NOPERM") => {
                        log::warn!(
                            "redis: INFO and CLUSTER INFO refused to this user, so taskhub \
                             assumes one server; for a Redis Cluster give several node URLs \
                             separated by commas"
                        );
                        false
                    }
                    // "This instance has cluster support disabled".
                    Err(_) => false,
                }
            }
            Err(e) => return Err(crate::redis::redis_unreachable(url, e)),
        };
        if !cluster {
            return Ok(RedisClient::Single(client));
        }
        // Every node known now is a seed too: a new connection (after a
        // failure, say) must not depend on the one node named in the URL.
        let mut seeds = vec![first.to_owned()];
        if let Ok(nodes) = redis::cmd("CLUSTER")
            .arg("NODES")
            .query::<String>(&mut conn)
        {
            seeds.extend(node_addresses(&nodes).map(|addr| with_address(first, &addr)));
        }
        let mut seen = std::collections::HashSet::new();
        seeds.retain(|seed| seen.insert(seed.clone()));
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        cluster_client(url, &seeds, tls)
    }

    /// A new connection whose commands time out after `read_timeout`.
    pub fn connect(&self, read_timeout: Duration) -> RedisResult<RedisConn> {
        let conn = match self {
            RedisClient::Single(client) => {
                let conn = client.get_connection_with_timeout(CONNECT_TIMEOUT)?;
                conn.set_write_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
                RedisConn::Single { conn, stale: false }
            }
            RedisClient::Cluster(client) => {
                let conn = client.get_connection()?;
                conn.set_write_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
                RedisConn::Cluster {
                    conn: Box::new(conn),
                    stale: false,
                }
            }
        };
        conn.set_read_timeout(read_timeout)?;
        Ok(conn)
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisClient::Cluster(_))
    }
}

/// The `host:port` of every healthy node in a `CLUSTER NODES` reply.
fn node_addresses(nodes: &str) -> impl Iterator<Item = String> + '_ {
    nodes.lines().filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (addr, flags) = (fields.get(1)?, fields.get(2)?);
        if flags.contains("fail") || flags.contains("noaddr") || flags.contains("handshake") {
            return None;
        }
        // ip:port@cport[,hostname]
        let addr = addr.split(['@', ',']).next()?;
        (!addr.starts_with(':')).then(|| addr.to_owned())
    })
}

/// `url` with its `host:port` replaced by `addr` (scheme, user, password and
/// database kept).
fn with_address(url: &str, addr: &str) -> String {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    let host_start = url[start..end].rfind('@').map_or(start, |i| start + i + 1);
    let addr = match addr.rsplit_once(':') {
        // An IPv6 address goes in brackets.
        Some((host, port)) if host.contains(':') && !host.starts_with('[') => {
            format!("[{host}]:{port}")
        }
        _ => addr.to_owned(),
    };
    format!("{}{addr}{}", &url[..host_start], &url[end..])
}

/// One connection to `url` (one server or a cluster), for the CLI and the
/// library's helpers; fails with the cause when Redis cannot be reached.
pub(crate) fn connect(url: &str, tls: &Tls) -> Result<RedisConn, Error> {
    RedisClient::open(url, tls)?
        .connect(REDIS_COMMAND_TIMEOUT)
        .map_err(|e| crate::redis::redis_unreachable(url, e))
}

fn cluster_client(url: &str, nodes: &[&str], tls: &Tls) -> Result<RedisClient, Error> {
    let bad = |e: redis::RedisError| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad Redis Cluster URL {:?}", redact(url)),
            e,
        )
    };
    let mut builder = ClusterClient::builder(nodes.to_vec())
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(REDIS_COMMAND_TIMEOUT)
        // Enough to follow a redirection or two; our own loops wait out
        // longer outages and keep an eye on the shutdown meanwhile.
        .retries(3)
        .min_retry_wait(50)
        .max_retry_wait(1_000);
    // The TLS mode (and #insecure) comes from the first node's URL; the CA
    // file and the client certificate from `tls`, for every node.
    if nodes.first().is_some_and(|n| is_tls_url(n)) {
        if let Some(certificates) = crate::tls::redis_certificates(tls)? {
            builder = builder.certs(certificates);
        }
    }
    let client = builder.build().map_err(bad)?;
    // Connect once, so that a wrong address fails now with its cause.
    let mut conn = client
        .get_connection()
        .map_err(|e| connect_failed(url, e))?;
    redis::cmd("PING")
        .query::<()>(&mut conn)
        .map_err(|e| crate::redis::redis_unreachable(url, e))?;
    log::debug!("redis: cluster mode, {} seed nodes", nodes.len());
    Ok(RedisClient::Cluster(client))
}

/// Checks that each stream shares its hash slot with its dead-letter stream,
/// as a cluster needs (see the module's documentation). Harmless on a
/// single server, where every key is on the one node.
pub(crate) fn check_slots(streams: &[String]) -> Result<(), Error> {
    use redis::cluster_routing::Slot;
    for stream in streams {
        let dlq = crate::redis::keys::dead_letter_stream(stream);
        if Slot::for_key(stream) != Slot::for_key(&dlq) {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "stream {stream:?} and its dead-letter stream {dlq:?} are in different \
                     hash slots of the Redis Cluster; name the stream with a hash tag, \
                     such as \"{{{stream}}}\", so both land on one node"
                ),
            ));
        }
    }
    Ok(())
}

/// Opens a Redis client for one server's `url` (no connection yet). A
/// `rediss://` URL uses TLS, verified with `tls` (its CA file, else the
/// system's store; `rediss://host:port/#insecure` skips the verification).
pub(crate) fn redis_client(url: &str, tls: &Tls) -> Result<redis::Client, Error> {
    let bad = |e: redis::RedisError| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad Redis URL {:?}", redact(url)),
            e,
        )
    };
    if !is_tls_url(url) {
        return redis::Client::open(url).map_err(bad);
    }
    match crate::tls::redis_certificates(tls)? {
        Some(certificates) => redis::Client::build_with_tls(url, certificates).map_err(bad),
        None => redis::Client::open(url).map_err(bad),
    }
}

/// Whether `url` is a Redis URL with TLS (`rediss://`, or valkey's
/// `valkeys://`).
pub(crate) fn is_tls_url(url: &str) -> bool {
    let scheme = url.split("://").next().unwrap_or_default();
    scheme.eq_ignore_ascii_case("rediss") || scheme.eq_ignore_ascii_case("valkeys")
}

/// A failed connection to `url` (one URL or the comma-separated seeds of a
/// cluster), said as [`redis_unreachable`] does, except for a `rediss://`
/// URL whose server never answered the TLS handshake: a Redis without TLS
/// on that port takes the ClientHello for the start of a command and waits
/// for its end, and the read times out with only "Resource temporarily
/// unavailable (os error 11)" to show for it.
fn connect_failed(url: &str, e: redis::RedisError) -> Error {
    let nodes: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .collect();
    if !nodes.first().is_some_and(|u| is_tls_url(u)) || !is_read_timeout(&e) {
        return redis_unreachable(url, e);
    }
    let mut addrs: Vec<String> = nodes.iter().filter_map(|u| host_port(u)).collect();
    let mut seen = std::collections::HashSet::new();
    addrs.retain(|a| seen.insert(a.clone()));
    if addrs.is_empty() {
        return redis_unreachable(url, e);
    }
    let addrs = addrs.join(", ");
    Error::new(
        ErrorKind::Redis,
        format!(
            "cannot connect to Redis at {}: the TLS handshake with {addrs} got no answer \
             within {}; the server may not speak TLS on that port (without TLS, use a \
             redis:// URL)",
            redact(url),
            humantime::format_duration(CONNECT_TIMEOUT),
        ),
    )
}

/// Whether `e` is a read that timed out (`EAGAIN`, the socket's read
/// timeout), not a TCP connection that could not be made (`ETIMEDOUT`).
/// Found in the text: redis-rs keeps the I/O error to itself, and a cluster
/// client reports its nodes' errors as text only.
fn is_read_timeout(e: &redis::RedisError) -> bool {
    e.is_io_error()
        && e.to_string()
            .contains(&std::io::Error::from_raw_os_error(libc::EAGAIN).to_string())
}

/// The `host:port` of a Redis URL (6379 when it names no port), without
/// its user and password.
fn host_port(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    let port = parsed.port().unwrap_or(6379);
    match parsed.host()? {
        url::Host::Ipv6(ip) => Some(format!("[{ip}]:{port}")),
        host => Some(format!("{host}:{port}")),
    }
}

pub(crate) fn redis_unreachable(url: &str, e: redis::RedisError) -> Error {
    Error::with_source(
        ErrorKind::Redis,
        format!("cannot connect to Redis at {}", redact(url)),
        e,
    )
}

#[cfg(test)]
mod tests {
    use super::{check_slots, host_port, is_read_timeout, node_addresses, with_address};

    #[test]
    fn seeds_keep_everything_but_the_address() {
        assert_eq!(
            with_address("rediss://u:p@redis-a:7000/0", "10.0.0.2:7001"),
            "rediss://u:p@10.0.0.2:7001/0"
        );
        assert_eq!(
            with_address("redis://127.0.0.1:7000", "::1:7002"),
            "redis://[::1]:7002"
        );
        let nodes = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7001@17001,host-b master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7002@17002 master,fail - 0 0 3 disconnected
d4 :0@0 slave,noaddr - 0 0 0 disconnected
";
        let found: Vec<String> = node_addresses(nodes).collect();
        assert_eq!(found, ["127.0.0.1:7000", "127.0.0.1:7001"]);
    }

    #[test]
    fn a_silent_tls_handshake_names_the_address_only() {
        assert_eq!(
            host_port("rediss://u:s3cret@redis-a:7000/0").as_deref(),
            Some("redis-a:7000")
        );
        assert_eq!(
            host_port("rediss://:s3cret@[::1]").as_deref(),
            Some("[::1]:6379")
        );
        let eagain = std::io::Error::from_raw_os_error(libc::EAGAIN);
        assert!(is_read_timeout(&eagain.into()));
        let etimedout = std::io::Error::from_raw_os_error(libc::ETIMEDOUT);
        assert!(!is_read_timeout(&etimedout.into()));
    }

    #[test]
    fn streams_need_a_hash_tag_on_a_cluster() {
        assert!(check_slots(&["{orders}".into(), "{app}:events".into()]).is_ok());
        let err = check_slots(&["orders".into()]).unwrap_err().to_string();
        assert!(err.contains("\"{orders}\""), "{err}");
        // An empty tag is no tag: the whole name is hashed.
        assert!(check_slots(&["{}orders".into()]).is_err());
    }
}
