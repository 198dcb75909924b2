// embserve_manifest_check ARTIFACT...: embserve::check_manifest on each folder, one line each:
// "ok" or "<ErrorKind>: <message>". Lets tests compare the C++ and Python manifest rules on many
// artifacts in one process.
#include <embserve/loader.h>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string line;
    try {
      embserve::check_manifest(argv[i]);
      line = "ok";
    } catch (const embserve::ManifestError& err) {
      line = std::string("ManifestError: ") + err.what();
    } catch (const embserve::ChecksumError& err) {
      line = std::string("ChecksumError: ") + err.what();
    } catch (const std::exception& err) {
      line = std::string("Error: ") + err.what();
    }
    for (char& c : line)
      if (c == '\n') c = ' ';
    std::cout << line << "\n";
  }
  return 0;
}
