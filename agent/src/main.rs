//! `teeguard-agent`: see the library crate for what it does.

use std::process::ExitCode;

use clap::Parser;
use teeguard_agent::cli::{Cli, Command, cleanup_command, run_command, scan_command};

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
        Command::Cleanup(args) => {
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
            match runtime.block_on(cleanup_command(&args, &mut std::io::stdout().lock())) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("teeguard-agent cleanup: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Run(args) => {
            // One thread runs everything: the work is one loop plus two watches and the admin
            // endpoint, and every extra worker costs a stack and a malloc arena (scans run on the
            // blocking pool).
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
            match runtime.block_on(run_command(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "teeguard-agent stopped");
                    eprintln!("teeguard-agent: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
