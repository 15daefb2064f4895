fn main() {
    std::process::exit(specula::cli::main());
}
