//! A private Redis Cluster on loopback ports, for the cluster tests: started
//! with `redis-server --cluster-enabled yes` and joined with
//! `redis-cli --cluster create`, as an operator would. [`StaleReplies`] sits
//! in front of one node and puts a leftover reply on its connections.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::certs::{Certs, Client};
use super::{free_port, output, wait_until, TempDir};

/// TLS only (client, bus and replication links), clients must show a
/// certificate signed by the CA (`tls-auth-clients yes`; `client` is the
/// tests' own), and an ACL user; the `default` user is off.
pub struct Secure {
    pub certs: Certs,
    pub client: Client,
    pub user: String,
    pub password: String,
}

pub struct Node {
    pub port: u16,
    bus_port: u16,
    dir: TempDir,
    child: Option<Child>,
    secure: Option<Arc<Secure>>,
}

impl Node {
    fn new(secure: Option<Arc<Secure>>) -> Node {
        Node {
            port: free_port(),
            bus_port: free_port(),
            dir: TempDir::new("taskhub-cluster-node"),
            child: None,
            secure,
        }
    }

    fn start(&mut self) {
        let mut cmd = Command::new("redis-server");
        match &self.secure {
            None => cmd.args(["--port", &self.port.to_string()]),
            Some(s) => cmd
                .args(["--port", "0", "--tls-port", &self.port.to_string()])
                .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                .args(["--tls-cert-file", s.certs.cert.to_str().unwrap()])
                .args(["--tls-key-file", s.certs.key.to_str().unwrap()])
                .args(["--tls-ca-cert-file", s.certs.ca.to_str().unwrap()])
                .args(["--tls-auth-clients", "yes"])
                .args(["--user", "default", "off"])
                .args(["--user", &s.user, "on", &format!(">{}", s.password)])
                .args(["~*", "&*", "+@all"])
                .args(["--masteruser", &s.user, "--masterauth", &s.password]),
        };
        let child = cmd
            .args(["--bind", "127.0.0.1"])
            .args(["--cluster-port", &self.bus_port.to_string()])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-config-file", "nodes.conf"])
            // Longer than the restarts the tests make: a restarted master
            // is not replaced by its replica behind the test's back.
            .args(["--cluster-node-timeout", "5000"])
            .args(["--dir", self.dir.0.to_str().unwrap()])
            // A node restarted after SIGKILL comes back with its data.
            .args(["--appendonly", "yes", "--appendfsync", "always"])
            .args(["--save", ""])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/test.sh installs it)");
        self.child = Some(child);
        assert!(
            wait_until(Duration::from_secs(10), || self.raw(&["PING"]).is_ok()),
            "cluster node {} did not start",
            self.addr()
        );
    }

    /// SIGKILL: a crash.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The URL a client uses (with the ACL user's password when secure).
    pub fn url(&self) -> String {
        match &self.secure {
            None => format!("redis://{}", self.addr()),
            Some(s) => format!("rediss://{}:{}@{}", s.user, s.password, self.addr()),
        }
    }

    /// One command to this node, without cluster routing.
    pub fn raw(&self, args: &[&str]) -> redis::RedisResult<redis::Value> {
        let client = match &self.secure {
            None => redis::Client::open(self.url())?,
            Some(s) => redis::Client::build_with_tls(
                self.url(),
                redis::TlsCertificates {
                    client_tls: Some(redis::ClientTlsConfig {
                        client_cert: std::fs::read(&s.client.cert).unwrap(),
                        client_key: std::fs::read(&s.client.key).unwrap(),
                    }),
                    root_cert: Some(std::fs::read(&s.certs.ca).unwrap()),
                },
            )?,
        };
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut conn)
    }

    fn text(&self, args: &[&str]) -> String {
        match self.raw(args) {
            Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
            Ok(redis::Value::VerbatimString { text, .. }) => text,
            Ok(other) => format!("{other:?}"),
            Err(e) => format!("error: {e}"),
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A Redis Cluster of `masters` masters, each with `replicas` replicas.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    pub fn start(masters: usize, replicas: usize) -> Cluster {
        Cluster::start_with(masters, replicas, None)
    }

    /// Like [`Cluster::start`], with TLS and an ACL user when `secure`.
    pub fn start_with(masters: usize, replicas: usize, secure: Option<Secure>) -> Cluster {
        let secure = secure.map(Arc::new);
        let mut nodes: Vec<Node> = (0..masters * (1 + replicas))
            .map(|_| Node::new(secure.clone()))
            .collect();
        for n in &mut nodes {
            n.start();
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for n in &nodes {
            create.arg(n.addr());
        }
        create
            .args(["--cluster-replicas", &replicas.to_string()])
            .arg("--cluster-yes");
        if let Some(s) = &secure {
            create
                .args(["--tls", "--cacert", s.certs.ca.to_str().unwrap()])
                .args(["--cert", s.client.cert.to_str().unwrap()])
                .args(["--key", s.client.key.to_str().unwrap()])
                .args(["--user", &s.user, "--pass", &s.password]);
        }
        let out = output(create, None, Duration::from_secs(60));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            out.stdout,
            out.stderr
        );
        let cluster = Cluster { nodes };
        cluster.wait_healthy();
        cluster
    }

    /// One seed URL: taskhub finds the other nodes itself.
    pub fn url(&self) -> String {
        self.url_of(0)
    }

    /// The URL of node `i`.
    pub fn url_of(&self, i: usize) -> String {
        self.nodes[i].url()
    }

    /// Every node's URL, comma-separated.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(Node::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Waits until every running node says the cluster is ok, and every
    /// replica is in sync with its master.
    pub fn wait_healthy(&self) {
        let ok = wait_until(Duration::from_secs(60), || {
            self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                n.text(&["CLUSTER", "INFO"]).contains("cluster_state:ok") && {
                    let repl = n.text(&["INFO", "replication"]);
                    repl.contains("role:master") || repl.contains("master_link_status:up")
                }
            })
        });
        assert!(
            ok,
            "the cluster did not become healthy:\n{}",
            self.describe()
        );
    }

    /// `CLUSTER NODES` as one node sees it.
    pub fn describe(&self) -> String {
        self.nodes
            .iter()
            .find(|n| n.child.is_some())
            .map(|n| n.text(&["CLUSTER", "NODES"]))
            .unwrap_or_default()
    }

    /// The index of the node that is master of `key`'s hash slot now.
    pub fn master_of(&self, key: &str) -> usize {
        let any = self.nodes.iter().find(|n| n.child.is_some()).unwrap();
        let slot = match any.raw(&["CLUSTER", "KEYSLOT", key]) {
            Ok(redis::Value::Int(s)) => s,
            other => panic!("CLUSTER KEYSLOT: {other:?}"),
        };
        for line in self.describe().lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") {
                continue;
            }
            let owns = f[8..].iter().any(|range| {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                matches!((a.parse::<i64>(), b.parse::<i64>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            if owns {
                let port: u16 = f[1]
                    .split('@')
                    .next()
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| p.parse().ok())
                    .unwrap();
                return self.nodes.iter().position(|n| n.port == port).unwrap();
            }
        }
        panic!("no master for slot {slot}:\n{}", self.describe());
    }

    /// SIGKILLs node `i`, waits `down`, starts it again on the same port and
    /// data, and waits until the cluster is healthy.
    pub fn restart(&mut self, i: usize, down: Duration) {
        self.nodes[i].kill();
        std::thread::sleep(down);
        self.nodes[i].start();
        self.wait_healthy();
    }

    /// Moves every slot of master `from` to master `to` with
    /// `redis-cli --cluster reshard` (keys migrate one by one: clients meet
    /// `ASK` during the move and `MOVED` after it).
    pub fn reshard(&self, from: usize, to: usize) {
        let id = |i: usize| self.nodes[i].text(&["CLUSTER", "MYID"]);
        let mut cmd = Command::new("redis-cli");
        cmd.args(["--cluster", "reshard", &self.nodes[from].addr()])
            .args(["--cluster-from", &id(from), "--cluster-to", &id(to)])
            .args(["--cluster-slots", "16384", "--cluster-yes"])
            .args(["--cluster-pipeline", "10"]);
        let out = output(cmd, None, Duration::from_secs(120));
        assert!(
            out.status.success(),
            "redis-cli --cluster reshard failed:\n{}{}",
            out.stdout,
            out.stderr
        );
        self.wait_healthy();
    }

    /// A manual failover: a replica of master `i` takes over its slots
    /// (`CLUSTER FAILOVER` on the replica). Returns the new master's index.
    pub fn failover(&self, i: usize) -> usize {
        let master_id = self.nodes[i].text(&["CLUSTER", "MYID"]);
        let replica = self
            .nodes
            .iter()
            .position(|n| {
                n.text(&["CLUSTER", "NODES"])
                    .lines()
                    .any(|l| l.contains("myself") && l.contains(&format!("slave {master_id}")))
            })
            .expect("master has a replica");
        let promoted = &self.nodes[replica];
        let reply = promoted.raw(&["CLUSTER", "FAILOVER"]);
        assert!(reply.is_ok(), "CLUSTER FAILOVER: {reply:?}");
        assert!(
            wait_until(Duration::from_secs(30), || promoted
                .text(&["INFO", "replication"])
                .contains("role:master")),
            "the failover did not happen:\n{}",
            self.describe()
        );
        // Until every node's view has the new master.
        let replica_id = promoted.text(&["CLUSTER", "MYID"]);
        assert!(
            wait_until(Duration::from_secs(30), || self.nodes.iter().all(|n| {
                n.text(&["CLUSTER", "NODES"])
                    .lines()
                    .any(|l| l.starts_with(&replica_id) && l.contains("master"))
            })),
            "the nodes did not learn of the failover:\n{}",
            self.describe()
        );
        self.wait_healthy();
        replica
    }
}

impl Cluster {
    /// Puts a [`StaleReplies`] proxy in front of node `i` (a master without
    /// replicas: a replica would replicate through it) and makes the node
    /// announce the proxy's port, so every client that learns the slots
    /// from now on talks to the node through the proxy.
    pub fn stale_replies(&self, i: usize) -> StaleReplies {
        let proxy = StaleReplies::start(self.nodes[i].port);
        let port = proxy.port.to_string();
        let reply = self.nodes[i].raw(&["CONFIG", "SET", "cluster-announce-port", &port]);
        assert!(reply.is_ok(), "CONFIG SET cluster-announce-port: {reply:?}");
        let announced = format!("127.0.0.1:{port}@");
        assert!(
            wait_until(Duration::from_secs(30), || self
                .nodes
                .iter()
                .all(|n| n.text(&["CLUSTER", "NODES"]).contains(&announced))),
            "the nodes did not learn the proxy's port:\n{}",
            self.describe()
        );
        proxy
    }
}

/// A TCP proxy in front of one node that, on [`StaleReplies::inject`],
/// puts one stale reply `:1` (what an `EXISTS` that found its key answers)
/// ahead of the next reply on each connection open at that moment: the
/// state of a connection on which a reply was left unread, so that every
/// later reply is read as the answer to the command after its own.
///
/// The `:1` goes in when the client sends its next request (redis-rs' sync
/// connections wait for every reply before they send again), so it always
/// lands between two replies, never inside one.
pub struct StaleReplies {
    pub port: u16,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    target: u16,
    stop: AtomicBool,
    /// Per connection: 0 passing, 1 armed, 2 inject before the next reply.
    conns: Mutex<Vec<Arc<AtomicU8>>>,
    injected: AtomicUsize,
    pumps: Mutex<Vec<JoinHandle<()>>>,
}

const PASS: u8 = 0;
const ARMED: u8 = 1;
const INJECT: u8 = 2;
const STALE: &[u8] = b":1\r\n";

impl StaleReplies {
    fn start(target: u16) -> StaleReplies {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            target,
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            injected: AtomicUsize::new(0),
            pumps: Mutex::new(Vec::new()),
        });
        let accept = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("stale-replies-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .unwrap()
        };
        StaleReplies {
            port,
            shared,
            accept: Some(accept),
        }
    }

    /// Arms every connection open now; returns how many.
    pub fn inject(&self) -> usize {
        let conns = self.shared.conns.lock().unwrap();
        for c in conns.iter() {
            let _ = c.compare_exchange(PASS, ARMED, SeqCst, SeqCst);
        }
        conns.len()
    }

    /// How many stale replies went out.
    pub fn injected(&self) -> usize {
        self.shared.injected.load(SeqCst)
    }
}

impl Drop for StaleReplies {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
        let pumps = std::mem::take(&mut *self.shared.pumps.lock().unwrap());
        for p in pumps {
            let _ = p.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(SeqCst) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(_) => continue,
        };
        let Ok(server) = TcpStream::connect(("127.0.0.1", shared.target)) else {
            continue;
        };
        let state = Arc::new(AtomicU8::new(PASS));
        shared.conns.lock().unwrap().push(state.clone());
        for (from, to, up) in [
            (
                client.try_clone().unwrap(),
                server.try_clone().unwrap(),
                true,
            ),
            (server, client, false),
        ] {
            let (ours, state) = (shared.clone(), state.clone());
            let pump = std::thread::Builder::new()
                .name("stale-replies-pump".into())
                .spawn(move || pump(from, to, up, &state, &ours))
                .unwrap();
            shared.pumps.lock().unwrap().push(pump);
        }
    }
}

/// Copies `from` to `to` until either closes or the proxy stops. Upstream
/// (client to node), a request on an armed connection orders the stale
/// reply; downstream, it goes out ahead of the next reply.
fn pump(mut from: TcpStream, mut to: TcpStream, up: bool, state: &AtomicU8, shared: &Shared) {
    from.set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let mut buf = vec![0u8; 16 * 1024];
    while !shared.stop.load(SeqCst) {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(_) => break,
        };
        if up {
            let _ = state.compare_exchange(ARMED, INJECT, SeqCst, SeqCst);
        } else if state.compare_exchange(INJECT, PASS, SeqCst, SeqCst).is_ok() {
            if to.write_all(STALE).is_err() {
                break;
            }
            shared.injected.fetch_add(1, SeqCst);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}
