//! The `taskhub` binary: parses flags, sets up logging and signals, calls the
//! library, maps errors to exit codes (0 ok, 1 failure, 2 usage).

use std::io::Write;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

mod cli;

/// Exactly-once effects from Redis Streams, with retries and dead letters.
#[derive(Parser, Debug)]
#[command(name = "taskhub", version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    servers: cli::servers::Servers,
    /// Log lines as text or as JSON objects (one per line). RUST_LOG sets the level.
    #[arg(
        long,
        global = true,
        env = "TASKHUB_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum LogFormat {
    Text,
    Json,
}

/// Logs to stderr; the library only uses the `log` facade.
fn init_logging(format: LogFormat) {
    let mut builder = env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("info,postgres=warn,tokio_postgres=warn"),
    );
    match format {
        LogFormat::Text => builder.format_timestamp_millis(),
        LogFormat::Json => builder.format(|buf, record| {
            let line = serde_json::json!({
                "ts": humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
                "level": record.level().as_str(),
                "target": record.target(),
                "msg": record.args().to_string(),
            });
            writeln!(buf, "{line}")
        }),
    };
    builder.init();
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Apply the database migrations (safe to run from several instances at once).
    Migrate,
    /// Consume streams and apply each event's effect exactly once.
    Run(Box<cli::run::RunArgs>),
    /// Add events to a stream: JSON lines on stdin, or --count demo events.
    Produce(cli::produce::ProduceArgs),
    /// Dead letters: stats, list, show, replay, purge, archive, check.
    #[command(long_about = cli::dlq::LONG_ABOUT)]
    Dlq(Box<cli::dlq::DlqArgs>),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(cli::docs::CompletionsArgs),
    /// Print the man page (roff): `taskhub man > /usr/local/share/man/man1/taskhub.1`.
    Man,
    /// Delete processed_events rows older than a retention, in small transactions.
    Prune(cli::prune::PruneArgs),
    /// Where each stream and its group stand: length, lag, pending, redelivered, dead letters, consumers.
    Status(cli::status::StatusArgs),
    /// List a group's consumers (pending entries, idle time), or remove one that left for good.
    Consumers(cli::consumers::ConsumersArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let mut cli = cli;
    let uses_database = match &cli.command {
        Command::Migrate | Command::Run(_) | Command::Prune(_) => true,
        Command::Dlq(args) => args.uses_database(),
        _ => false,
    };
    if let Err(message) = cli.servers.read_files(uses_database) {
        eprintln!("taskhub: error: {message}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Migrate => taskhub::migrate(&cli.servers.database_url)
            .map(|n| println!("migrations applied: {n}"))
            .map_err(|e| cli::report(&e)),
        Command::Run(args) => cli::run::run(&cli.servers, *args),
        Command::Produce(args) => cli::produce::produce(&cli.servers, args),
        Command::Consumers(args) => cli::consumers::consumers(&cli.servers, args),
        Command::Completions(args) => cli::docs::completions(Cli::command(), args),
        Command::Man => cli::docs::man(Cli::command()),
        Command::Prune(args) => cli::prune::prune(&cli.servers, args),
        Command::Status(args) => match cli::status::status(&cli.servers, args) {
            Ok(code) => return code,
            Err(message) => Err(message),
        },
        Command::Dlq(args) => {
            let tls = cli.servers.redis_tls();
            match cli::dlq::run(
                &cli.servers.redis_url,
                &tls,
                &cli.servers.database_url,
                *args,
            ) {
                Ok(code) => return code,
                Err(message) => Err(message),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("taskhub: error: {message}");
            ExitCode::FAILURE
        }
    }
}
