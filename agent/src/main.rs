//! `teeguard-agent`: see the library crate for what it does.

use std::process::ExitCode;

use clap::Parser;
use teeguard_agent::cli::{Cli, Command, cleanup_command, run_command};
use teeguard_agent::scan::scan_command;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Scan(args) => match scan_command(&args, &mut std::io::stdout().lock()) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("teeguard-agent scan: {e}");
                ExitCode::from(2)
            }
        },
        Command::Cleanup(args) => on_one_thread(
            "teeguard-agent cleanup",
            cleanup_command(&args, &mut std::io::stdout().lock()),
        ),
        // One thread runs everything: the work is one loop plus two watches and the admin endpoint,
        // and every extra worker costs a stack and a malloc arena (scans run on the blocking pool).
        Command::Run(args) => on_one_thread("teeguard-agent", async {
            let result = run_command(args).await;
            if let Err(e) = &result {
                tracing::error!(error = %e, "teeguard-agent stopped");
            }
            result
        }),
    }
}

/// Run `work` on a single-threaded runtime; an error is printed after `what`.
fn on_one_thread(
    what: &str,
    work: impl std::future::Future<Output = teeguard_agent::error::Result<()>>,
) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("teeguard-agent: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{what}: {e}");
            ExitCode::FAILURE
        }
    }
}
