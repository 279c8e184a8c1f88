//! `teeguard-webhook`: parse the command line and run it.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = teeguard_webhook::cli::Cli::parse();
    match teeguard_webhook::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("teeguard-webhook: {e}");
            ExitCode::FAILURE
        }
    }
}
