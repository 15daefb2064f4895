use anyhow::Result;

#[derive(clap::Args)]
pub struct FetchArgs {
    /// Keys to fetch (models and data sets).
    keys: Vec<String>,
    /// List the known keys and whether each is present.
    #[arg(long)]
    list: bool,
}

pub fn run(args: FetchArgs) -> Result<()> {
    if args.list || args.keys.is_empty() {
        for a in crate::fetch::assets() {
            let present = if crate::fetch::is_fetched(a.key) { "present" } else { "-" };
            println!("{:<22} {:<8} {}", a.key, present, a.path().display());
        }
        return Ok(());
    }
    for key in &args.keys {
        let path = crate::fetch::fetch(key, true)?;
        println!("{key}: {}", path.display());
    }
    Ok(())
}
