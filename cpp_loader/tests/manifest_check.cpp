// embserve_manifest_check [--load] ARTIFACT...: embserve::check_manifest on each folder (with --load,
// embserve::Model::load: the manifest, checksums and every kernel attribute), one line each:
// "ok" or "<ErrorKind>: <message>". Lets tests compare the C++ and Python rules on many artifacts in one process.
#include <embserve/loader.h>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  const bool load = argc > 1 && std::string(argv[1]) == "--load";
  for (int i = load ? 2 : 1; i < argc; ++i) {
    std::string line;
    try {
      if (load)
        embserve::Model::load(argv[i]);
      else
        embserve::check_manifest(argv[i]);
      line = "ok";
    } catch (const embserve::ManifestError& err) {
      line = std::string("ManifestError: ") + err.what();
    } catch (const embserve::ChecksumError& err) {
      line = std::string("ChecksumError: ") + err.what();
    } catch (const embserve::ModelError& err) {
      line = std::string("ModelError: ") + err.what();
    } catch (const std::exception& err) {
      line = std::string("Error: ") + err.what();
    }
    for (char& c : line)
      if (c == '\n') c = ' ';
    std::cout << line << "\n";
  }
  return 0;
}
