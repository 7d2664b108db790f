//! `taskhub completions <shell>` and `taskhub man`: the shell completion
//! script and the man page, generated from the same definitions as `--help`.

use std::io::Write;

use clap::Args;

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    pub shell: clap_complete::Shell,
}

/// Prints the completion script of `shell` for `command`.
pub fn completions(mut command: clap::Command, args: CompletionsArgs) -> Result<(), String> {
    let mut out = Vec::new();
    clap_complete::generate(args.shell, &mut command, "taskhub", &mut out);
    super::print(&String::from_utf8_lossy(&out))
}

/// Prints the man page of `command` (roff), with a page per subcommand
/// folded in as sections.
pub fn man(command: clap::Command) -> Result<(), String> {
    let mut out = Vec::new();
    let man = clap_mangen::Man::new(command.clone());
    man.render(&mut out).map_err(|e| e.to_string())?;
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = sub.get_name().to_owned();
        let _ = writeln!(out, ".SH \"TASKHUB {}\"", name.to_uppercase());
        let page = clap_mangen::Man::new(sub.clone());
        page.render_description_section(&mut out)
            .and_then(|()| page.render_options_section(&mut out))
            .map_err(|e| e.to_string())?;
    }
    super::print(&String::from_utf8_lossy(&out))
}
