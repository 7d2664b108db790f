//! A private Redis Cluster on loopback ports, for the cluster tests: started
//! with `redis-server --cluster-enabled yes` and joined with
//! `redis-cli --cluster create`, as an operator would.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, output, wait_until, TempDir};

pub struct Node {
    pub port: u16,
    bus_port: u16,
    dir: TempDir,
    child: Option<Child>,
}

impl Node {
    fn new() -> Node {
        Node {
            port: free_port(),
            bus_port: free_port(),
            dir: TempDir::new("taskhub-cluster-node"),
            child: None,
        }
    }

    fn start(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
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
        let addr = self.addr();
        assert!(
            wait_until(Duration::from_secs(10), || raw(&addr, &["PING"]).is_ok()),
            "cluster node {addr} did not start"
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
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One command to one node, without cluster routing.
pub fn raw(addr: &str, args: &[&str]) -> redis::RedisResult<redis::Value> {
    let client = redis::Client::open(format!("redis://{addr}"))?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(2))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query(&mut conn)
}

fn text(addr: &str, args: &[&str]) -> String {
    match raw(addr, args) {
        Ok(redis::Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
        Ok(redis::Value::VerbatimString { text, .. }) => text,
        Ok(other) => format!("{other:?}"),
        Err(e) => format!("error: {e}"),
    }
}

/// A Redis Cluster of `masters` masters, each with `replicas` replicas.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

impl Cluster {
    pub fn start(masters: usize, replicas: usize) -> Cluster {
        let mut nodes: Vec<Node> = (0..masters * (1 + replicas)).map(|_| Node::new()).collect();
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
        format!("redis://{}", self.nodes[i].addr())
    }

    /// Every node's URL, comma-separated.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("redis://{}", n.addr()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Waits until every running node says the cluster is ok, and every
    /// replica is in sync with its master.
    pub fn wait_healthy(&self) {
        let ok = wait_until(Duration::from_secs(60), || {
            self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let addr = n.addr();
                text(&addr, &["CLUSTER", "INFO"]).contains("cluster_state:ok") && {
                    let repl = text(&addr, &["INFO", "replication"]);
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
            .map(|n| text(&n.addr(), &["CLUSTER", "NODES"]))
            .unwrap_or_default()
    }

    /// The index of the node that is master of `key`'s hash slot now.
    pub fn master_of(&self, key: &str) -> usize {
        let any = self.nodes.iter().find(|n| n.child.is_some()).unwrap();
        let slot = match raw(&any.addr(), &["CLUSTER", "KEYSLOT", key]) {
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
        let id = |i: usize| text(&self.nodes[i].addr(), &["CLUSTER", "MYID"]);
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
        let master_id = text(&self.nodes[i].addr(), &["CLUSTER", "MYID"]);
        let replica = self
            .nodes
            .iter()
            .position(|n| {
                text(&n.addr(), &["CLUSTER", "NODES"])
                    .lines()
                    .any(|l| l.contains("myself") && l.contains(&format!("slave {master_id}")))
            })
            .expect("master has a replica");
        let reply = raw(&self.nodes[replica].addr(), &["CLUSTER", "FAILOVER"]);
        assert!(reply.is_ok(), "CLUSTER FAILOVER: {reply:?}");
        let addr = self.nodes[replica].addr();
        assert!(
            wait_until(Duration::from_secs(30), || text(
                &addr,
                &["INFO", "replication"]
            )
            .contains("role:master")),
            "the failover did not happen:\n{}",
            self.describe()
        );
        // Until every node's view has the new master.
        let replica_id = text(&addr, &["CLUSTER", "MYID"]);
        assert!(
            wait_until(Duration::from_secs(30), || self.nodes.iter().all(|n| {
                text(&n.addr(), &["CLUSTER", "NODES"])
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
